/* The CPU kernels in C, compiled ahead of the first request by the machine's C compiler (native.py
 * builds one shared library per instruction path and loads it with ctypes): the same computations
 * as the numba kernels beside this file (int8.py, attention.py, layer.py, cpu.py), without a
 * compile step of many seconds at a model's first load.
 *
 * One source, built once per path with -DTS_PATH=<isa.IDS id> and that path's -m flags:
 *   0 vnni512  vpdpbusd on 512-bit vectors          2 avx2     vpmaddubsw + vpmaddwd (vpsignb for q8)
 *   1 avxvnni  vpdpbusd on 256-bit vectors          4 generic  plain C (any CPU; the compiler vectorises)
 *   3 neon     sdot (aarch64 with dotprod)
 * The integer dots are exact, and every float step runs in the written order (-ffp-contract=off, no
 * fast-math; sums over a vector in 16 fixed lanes, then a fixed tree), so every path gives the same
 * bits as every other.
 *
 * NOTE(exact-batching), NOTE(exact-prefix): as in the numba kernels, every row is computed on its
 * own by the same code whatever rows stand beside it, attention's key chunks are fixed by absolute
 * position and merged in chunk order, so batching, prefix reuse and how a prompt was cut never
 * change a row's bits.
 *
 * Threads: OpenMP, `nthreads` per call (the caller's choice, as numba's set_num_threads).
 *
 * Memory: the kernels that need working buffers take them from the calling thread's scratch block
 * (NOTE(scratch), below) and return TS_OK, or TS_NOMEM having done nothing.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
#endif

#ifndef TS_PATH
#define TS_PATH 4
#endif
#define TS_ABI 7
#define TS_OK 0
#define TS_NOMEM 1

#define ROWS 8           /* attention: rows of one sequence in a block */
#define CHUNK 256        /* attention: keys in a chunk (fixed by absolute position) */
#define AHEAD 16         /* attention: keys ahead whose K/V lines are asked for */
#define SPREAD_BELOW 32  /* attention: fewer (block, KV head) pairs: chunks computed in parallel */
#define EMPTY (-3.0e38f) /* a partial's max where its chunk holds no key of the row */
#define LANES 16
#define LAYER_PARTS 8    /* ts_layer_weights: parts of a layer's four products, at most */

typedef int64_t i64;

int ts_path(void) { return TS_PATH; }
int ts_abi(void) { return TS_ABI; }

/* ---- small float helpers ------------------------------------------------------------------- */

static inline float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    float f;
    if (e == 0) {
        f = (float)m * 0x1p-24f;
        return s ? -f : f;
    }
    bits = e == 31 ? s | 0x7f800000u | (m << 13) : s | ((e + 112u) << 23) | (m << 13);
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* The bits of the half float nearest x (ties to even), x clamped to the half range first
 * (NOTE(kv-half): no K/V element is ever inf). */
static inline uint16_t f2h(float x) {
    x = x < -65504.0f ? -65504.0f : x > 65504.0f ? 65504.0f : x;
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t b, s;
    memcpy(&b, &x, 4);
    s = (b >> 16) & 0x8000u;
    b &= 0x7fffffffu;
    if (b >= 0x38800000u) {                      /* a normal half */
        uint32_t r = b - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (uint16_t)(s | (r >> 13));
    }
    float a;
    memcpy(&a, &b, 4);
    return (uint16_t)(s | (uint32_t)lrintf(a * 0x1p24f));   /* subnormal (or zero) */
#endif
}

/* the K/V store's conversions, for tests: n values each way */
void ts_to_half(const float *x, i64 n, uint16_t *out) {
    for (i64 j = 0; j < n; j++) out[j] = f2h(x[j]);
}
void ts_from_half(const uint16_t *h, i64 n, float *out) {
    for (i64 j = 0; j < n; j++) out[j] = h2f(h[j]);
}

/* 2**n for n in [-126, 127] */
static inline float pow2i(int32_t n) {
    uint32_t bits = (uint32_t)(n + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* e^x (x clamped to [-87, 88]): x = n ln2 + r, e^r by Cephes' expf polynomial, times 2^n */
static inline float ts_exp(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return (p * r * r + r + 1.0f) * pow2i((int32_t)n);
}

/* ts_exp on 16 or 8 values at once: the same operations in the same order, so the same bits */
#define TS_EXP_BODY(W, P, ROUND, CVT)                                                                         \
    x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.0f)), P##_set1_ps(88.0f));                                  \
    W k = ROUND(P##_add_ps(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)), P##_set1_ps(0.5f)));             \
    W r = P##_add_ps(P##_sub_ps(x, P##_mul_ps(k, P##_set1_ps(0.693359375f))),                                 \
                     P##_mul_ps(k, P##_set1_ps(2.12194440e-4f)));                                             \
    W p = P##_add_ps(P##_mul_ps(P##_set1_ps(1.9875691500e-4f), r), P##_set1_ps(1.3981999507e-3f));            \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(8.3334519073e-3f));                                          \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(4.1665795894e-2f));                                          \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(1.6666665459e-1f));                                          \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(5.0000001201e-1f));                                          \
    W e = P##_add_ps(P##_add_ps(P##_mul_ps(P##_mul_ps(p, r), r), r), P##_set1_ps(1.0f));                      \
    return P##_mul_ps(e, CVT(k));
#if defined(__AVX512F__)
#define FLOOR512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define POW2_512(k) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23))
static inline __m512 exp512(__m512 x) { TS_EXP_BODY(__m512, _mm512, FLOOR512, POW2_512) }
#endif
#if defined(__AVX2__)
#define POW2_256(k) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23))
static inline __m256 exp256(__m256 x) { TS_EXP_BODY(__m256, _mm256, _mm256_floor_ps, POW2_256) }
#endif

/* WIDE(M): M's loop on this build's widest float vectors (16 or 8 lanes), or nothing */
#if defined(__AVX512F__)
#define WIDE(M) M(16, __m512, _mm512, exp512)
#elif defined(__AVX2__)
#define WIDE(M) M(8, __m256, _mm256, exp256)
#else
#define WIDE(M)
#endif

/* s[j] = ts_exp(s[j] - m) for j < n */
#define EXP_SHIFTED(N, W, P, EXP)                                                                              \
    for (; j + N <= n; j += N) P##_storeu_ps(s + j, EXP(P##_sub_ps(P##_loadu_ps(s + j), P##_set1_ps(m))));
static inline void exp_shifted(float *s, i64 n, float m) {
    i64 j = 0;
    WIDE(EXP_SHIFTED)
    for (; j < n; j++) s[j] = ts_exp(s[j] - m);
}

/* o[j] = g[j] / (1 + ts_exp(-z)) * u[j] with z = g[j] (SiLU) or cg (g + 0.044715 g^3) (GELU, tanh form) */
#define GATE(N, W, P, EXP)                                                                                       \
    for (; j + N <= F; j += N) {                                                                                 \
        W gv = P##_loadu_ps(g + j), z = gv;                                                                      \
        if (gelu)                                                                                                \
            z = P##_mul_ps(P##_set1_ps(cg),                                                                      \
                           P##_add_ps(gv, P##_mul_ps(P##_mul_ps(P##_mul_ps(P##_set1_ps(0.044715f), gv), gv), gv))); \
        W den = P##_add_ps(P##_set1_ps(1.0f), EXP(P##_sub_ps(P##_setzero_ps(), z)));                             \
        P##_storeu_ps(o + j, P##_mul_ps(P##_div_ps(gv, den), P##_loadu_ps(u + j)));                              \
    }
static inline void gate_row(const float *g, const float *u, float *o, i64 F, int gelu, float cg) {
    i64 j = 0;
    WIDE(GATE)
    for (; j < F; j++) {
        const float z = gelu ? cg * (g[j] + 0.044715f * g[j] * g[j] * g[j]) : g[j];
        o[j] = g[j] / (1.0f + ts_exp(-z)) * u[j];
    }
}

/* the sum of 16 lanes in a fixed tree */
static inline float lanes_total(const float *l) {
    float a[8];
    for (int k = 0; k < 8; k++) a[k] = l[k] + l[k + 8];
    for (int k = 0; k < 4; k++) a[k] = a[k] + a[k + 4];
    a[0] = a[0] + a[2];
    a[1] = a[1] + a[3];
    return a[0] + a[1];
}

/* lanes_total's tree on vectors: (l, l+8), then (l, l+4), (l, l+2), (l, l+1) */
#if defined(__AVX2__)
static inline float hsum128(__m128 a) {                       /* a = lanes 0..3 after two steps */
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));                    /* (0 + 2), (1 + 3) */
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}
static inline float hsum256x2(__m256 lo, __m256 hi) {
    __m256 a = _mm256_add_ps(lo, hi);
    return hsum128(_mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
}
#endif
#if defined(__AVX512F__)
static inline float hsum512(__m512 v) {
    return hsum256x2(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

static inline int threads_for(int nthreads, i64 work) {
    if (nthreads < 1) nthreads = 1;
    return work < nthreads ? (int)(work < 1 ? 1 : work) : nthreads;
}

/* ---- scratch --------------------------------------------------------------------------------- */

/* NOTE(scratch): a kernel's working buffers are cut from one block of memory per calling thread,
 * made at the first call, grown when a call needs more and otherwise kept, so a call in the steady
 * state allocates nothing. A call lays out everything it needs first (its nested kernels' buffers
 * too) and makes the block that large before any work: a call that cannot get its memory does
 * nothing and returns TS_NOMEM. A buffer used inside a parallel region has one slot per thread
 * number of the team, each on whole 64-byte lines. Per calling thread: ctypes lets go of the GIL,
 * so two Python threads may call at once (the engine calls from its one compute thread). A thread's
 * block is freed when the thread ends, or by ts_release_scratch(). */
#define ALIGN 64

typedef struct {
    char *base;
    size_t cap;
} scratch_block;

static _Thread_local scratch_block scratch;
static _Thread_local i64 fail_at;        /* tests: the fail_at-th allocation from now fails (0: none) */
static _Thread_local size_t failed;      /* the bytes of this thread's last allocation that failed */
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_keyed;                 /* pthread_key_create succeeded */

static void scratch_drop(void *block) {
    scratch_block *b = (scratch_block *)block;
    free(b->base);
    b->base = NULL;
    b->cap = 0;
}

static void scratch_key_make(void) { scratch_keyed = pthread_key_create(&scratch_key, scratch_drop) == 0; }

static inline size_t lines(size_t bytes) { return (bytes + ALIGN - 1) & ~(size_t)(ALIGN - 1); }

/* the one allocation of this file: makes this thread's block hold `bytes` (its old contents are not
 * kept); TS_NOMEM where the memory is not there */
static int scratch_reserve(size_t bytes) {
    if (bytes <= scratch.cap) return TS_OK;
    const size_t cap = lines(bytes);
    scratch_drop(&scratch);
    void *p = fail_at > 0 && --fail_at == 0 ? NULL : aligned_alloc(ALIGN, cap);
    if (p == NULL) {
        failed = cap;
        return TS_NOMEM;
    }
    scratch.base = (char *)p;
    scratch.cap = cap;
    pthread_once(&scratch_once, scratch_key_make);
    if (scratch_keyed) pthread_setspecific(scratch_key, &scratch);     /* freed at the thread's end */
    return TS_OK;
}

/* frees the calling thread's scratch block (the next call makes it again) */
void ts_release_scratch(void) { scratch_drop(&scratch); }
/* the bytes the calling thread's block holds */
i64 ts_scratch_bytes(void) { return (i64)scratch.cap; }
/* the bytes of the calling thread's last allocation that failed */
i64 ts_failed_bytes(void) { return (i64)failed; }
/* tests: the n-th allocation the calling thread makes from now fails (n = 0: none fails) */
void ts_fail_next_alloc(i64 n) { fail_at = n; }

/* a layout cut from the block: first measured (base NULL), then cut for real (scratch_begin) */
typedef struct {
    char *base;
    size_t used;
    int bad;        /* a size out of range: no block is that large */
} cut;

/* `count` items of `size` bytes, on whole lines */
static void *take(cut *c, i64 count, size_t size) {
    const size_t room = c->used < SIZE_MAX / 4 ? SIZE_MAX / 4 - c->used : 0;
    if (count < 0 || (size && (size_t)count > room / size)) {
        c->bad = 1;
        return NULL;
    }
    void *p = c->base ? c->base + c->used : NULL;
    c->used += lines((size_t)count * size);
    return p;
}

/* the measured layout's block, to cut the layout again from it; TS_NOMEM where it is not there */
static int scratch_begin(cut *c) {
    if (c->bad || scratch_reserve(c->used ? c->used : ALIGN) != TS_OK) {
        if (c->bad) failed = SIZE_MAX;
        return TS_NOMEM;
    }
    c->base = scratch.base;
    c->used = 0;
    return TS_OK;
}

/* ---- int8 activations (int8.py) ------------------------------------------------------------ */

/* A quantized weight as the int8 kernels read it (int8.prepare): qv u8 [T, nu, R/16, quads, 16, 4],
 * d and m (q4 mins, or NULL) [T, nu, R]: `half` 0: f32, 1: half floats, 2: K-quant integers (q4:
 * uint8, q8: int8) times the f32 super scales ds, ms [T, nu/group, R] (quant.py, NOTE(k-scales));
 * `mins` 0: q8 (none), 1: q4 with m, 2: q4 with m = -8d (Q4_0, no m kept: quant.py,
 * NOTE(scales-f16)); K inputs, T*R outputs. `six`: a q8 weight in units of 16 kept in 6 bits, 3
 * blocks a unit (quant.py, NOTE(q6)); always with K-quant scales (half 2). */
typedef struct {
    const uint8_t *qv;
    const void *d;
    const void *m;
    i64 T, nu, R, K;
    i64 half, mins;
    const float *ds;
    const float *ms;
    i64 group;
    i64 six;
} ts_weight;

/* x [B, K] -> q [B, K] int8, d [B, K/32] (max|x| / 127 per block), xs [B, K/32] (d * sum(q)),
 * qsum [B, K/16] (sum of q per half block). */
void ts_quantize_rows(const float *x, i64 B, i64 K, int8_t *q, float *d, float *xs, int32_t *qsum, int nthreads) {
    int nt = threads_for(nthreads, B / 4);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (i64 i = 0; i < B; i++) {
        for (i64 b = 0; b < K / 32; b++) {
            const float *xb = x + i * K + b * 32;
            int8_t *qb = q + i * K + b * 32;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) {
                float a = fabsf(xb[j]);
                amax = a > amax ? a : amax;
            }
            float db = amax / 127.0f;
            float inv = db > 0.0f ? 1.0f / db : 0.0f;
            int32_t s0 = 0, s1 = 0;
            for (int j = 0; j < 16; j++) {
                int32_t v = (int32_t)rintf(xb[j] * inv);
                qb[j] = (int8_t)v;
                s0 += v;
            }
            for (int j = 16; j < 32; j++) {
                int32_t v = (int32_t)rintf(xb[j] * inv);
                qb[j] = (int8_t)v;
                s1 += v;
            }
            d[i * (K / 32) + b] = db;
            xs[i * (K / 32) + b] = db * (float)(s0 + s1);
            qsum[i * (K / 16) + 2 * b] = s0;
            qsum[i * (K / 16) + 2 * b + 1] = s1;
        }
    }
}

/* The exact int32 dots of one weight unit with one row's activations `a`, for 16 output rows
 * (`vi`): w holds `quads` groups of [16 rows, 4 bytes]; q4 (nib): low nibbles meet a[0:16], high
 * a[16:32]; q8: bytes are q + 128 (the VNNI paths take 128 * qa_sum, the sum of a, off again).
 * The result is the plain signed dots sum(q * q_a) on every path. `vf`: 16 floats, one per row. */
#define ALWAYS static inline __attribute__((always_inline))
/* K-quant scale `at` of p (int8 where sgn, else uint8) times its f32 super scale (NOTE(k-scales)) */
ALWAYS float kscale(const void *p, i64 at, int sgn, float sup) {
    return (float)(sgn ? ((const int8_t *)p)[at] : ((const uint8_t *)p)[at]) * sup;
}
/* NOTE(q6): a unit of 16 weights (Q6_K's sub-block) x 16 rows in 6 bits is 3 blocks of [16 rows, 4
 * bytes] (byte 4r + e): block 0's low nibbles hold the low 4 bits of weights 0-3 of each row, its high
 * nibbles those of 8-11; block 1 the same of 4-7 and 12-15; block 2 the top 2 bits of weight 4g + e
 * at bits 2g. A weight is q + 32 (0..63). six_byte: byte `at` of quad g (weights 4g..4g+3) as a q8
 * unit holds it, q + 128. */
ALWAYS uint8_t six_byte(const uint8_t *w, int g, int at) {
    const int n = w[64 * (g & 1) + at], lo = g < 2 ? n & 15 : n >> 4;
    return (uint8_t)((lo | ((w[128 + at] >> (2 * g)) & 3) << 4) + 96);
}
#if TS_PATH <= 2
/* the 4 quads of half h (rows 8h..8h+7) of a 6-bit unit as bytes q + 32 (0..63), from its 3 blocks
 * read once; the dots take 32 * sum(q_a) off again */
ALWAYS void six_quads256(const uint8_t *w, int h, __m256i v[4]) {
    const __m256i n0 = _mm256_loadu_si256((const __m256i *)(w + 32 * h));
    const __m256i n1 = _mm256_loadu_si256((const __m256i *)(w + 64 + 32 * h));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    v[0] = _mm256_or_si256(_mm256_and_si256(n0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2));
    v[1] = _mm256_or_si256(_mm256_and_si256(n1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n0, 4), m4), _mm256_and_si256(hb, m2));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n1, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2));
}
#endif

#if TS_PATH == 0
typedef __m512i vi;
typedef __m512 vf;
ALWAYS vi unit_dot(const uint8_t *w, const int8_t *a, int quads, int nib, int32_t qa_sum, int six) {
    vi acc = _mm512_set1_epi32(nib ? 0 : (six ? -32 : -128) * qa_sum);
    const vi mask = _mm512_set1_epi8(0x0F);
    __m256i lo[4], hi[4];
    if (six) six_quads256(w, 0, lo), six_quads256(w, 1, hi);
    for (int g = 0; g < quads; g++) {
        vi v = six ? _mm512_inserti64x4(_mm512_castsi256_si512(lo[g & 3]), hi[g & 3], 1)
                   : _mm512_loadu_si512((const void *)(w + 64 * g));
        int32_t a0, a1;
        memcpy(&a0, a + 4 * g, 4);
        if (nib) {
            memcpy(&a1, a + 16 + 4 * g, 4);
            acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(v, mask), _mm512_set1_epi32(a0));
            acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(_mm512_srli_epi32(v, 4), mask), _mm512_set1_epi32(a1));
        } else {
            acc = _mm512_dpbusd_epi32(acc, v, _mm512_set1_epi32(a0));
        }
    }
    return acc;
}
ALWAYS void vi_store(int32_t *out, vi v) { _mm512_storeu_si512((void *)out, v); }
ALWAYS vf vf_zero(void) { return _mm512_setzero_ps(); }
ALWAYS void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
/* 16 scales from p: half floats (converted exactly), f32, or (half 2) integers (int8 where sgn,
 * else uint8) times their f32 super scales `sup` */
ALWAYS vf vf_scales(const void *p, const float *sup, int half, int sgn) {
    if (half == 2) {
        const __m128i b = _mm_loadu_si128((const __m128i *)p);
        const __m512i i = sgn ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
        return _mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_loadu_ps(sup));
    }
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_ps((const float *)p);
}
/* acc + (d * s) * dots, then + m * x for q4 (mins 1: m loaded; 2: m = -8d, exact in f32) */
ALWAYS vf vf_update(vf acc, const void *d, const float *ds, float s, vi dots, const void *m, const float *ms, float x,
                    int half, int mins) {
    const vf dv = vf_scales(d, ds, half, mins == 0);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(dv, _mm512_set1_ps(s)), _mm512_cvtepi32_ps(dots)));
    if (!mins) return acc;
    const vf mv = mins == 2 ? _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f)) : vf_scales(m, ms, half, 0);
    return _mm512_add_ps(acc, _mm512_mul_ps(mv, _mm512_set1_ps(x)));
}
#elif TS_PATH == 1 || TS_PATH == 2
typedef struct { __m256i h[2]; } vi;
typedef struct { __m256 h[2]; } vf;
#if TS_PATH == 1
#if defined(__AVXVNNI__)
#define DPBUSD256(acc, w, a) _mm256_dpbusd_avx_epi32(acc, w, a)
#else
#define DPBUSD256(acc, w, a) _mm256_dpbusd_epi32(acc, w, a)     /* the EVEX form (AVX512-VNNI + VL) */
#endif
#endif
ALWAYS vi unit_dot(const uint8_t *w, const int8_t *a, int quads, int nib, int32_t qa_sum, int six) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    vi out;
#if TS_PATH == 1
    out.h[0] = out.h[1] = _mm256_set1_epi32(nib ? 0 : (six ? -32 : -128) * qa_sum);
    __m256i sv[2][4];
    if (six) six_quads256(w, 0, sv[0]), six_quads256(w, 1, sv[1]);
    for (int g = 0; g < quads; g++) {
        int32_t a0, a1;
        memcpy(&a0, a + 4 * g, 4);
        memcpy(&a1, a + 16 + 4 * g, 4);
        for (int h = 0; h < 2; h++) {
            __m256i v = six ? sv[h][g & 3] : _mm256_loadu_si256((const __m256i *)(w + 64 * g + 32 * h));
            if (nib) {
                out.h[h] = DPBUSD256(out.h[h], _mm256_and_si256(v, mask), _mm256_set1_epi32(a0));
                out.h[h] = DPBUSD256(out.h[h], _mm256_and_si256(_mm256_srli_epi32(v, 4), mask), _mm256_set1_epi32(a1));
            } else {
                out.h[h] = DPBUSD256(out.h[h], v, _mm256_set1_epi32(a0));
            }
        }
    }
#else
    /* q4: nibble (<= 15) x |a| (<= 127): a pair sums to <= 3810, so all 8 products of a unit add up
     * in int16 before one vpmaddwd. q8: |q| (<= 128) takes its sign onto a (vpsignb): one pair
     * reaches 2 * 128 * 127 = 32512 and is widened at once. */
    const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
    if (six) {
        /* q + 32 (<= 63) x |a| (<= 127): two quads' pairs sum to <= 32004 in int16 */
        for (int h = 0; h < 2; h++) {
            __m256i v[4], s16[2];
            six_quads256(w, h, v);
            for (int k = 0; k < 2; k++) {
                int32_t a0, a1;
                memcpy(&a0, a + 8 * k, 4);
                memcpy(&a1, a + 8 * k + 4, 4);
                s16[k] = _mm256_add_epi16(_mm256_maddubs_epi16(v[2 * k], _mm256_set1_epi32(a0)),
                                          _mm256_maddubs_epi16(v[2 * k + 1], _mm256_set1_epi32(a1)));
            }
            out.h[h] = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(s16[0], ones), _mm256_madd_epi16(s16[1], ones)),
                                        _mm256_set1_epi32(-32 * qa_sum));
        }
        return out;
    }
    for (int h = 0; h < 2; h++) {
        __m256i acc = _mm256_setzero_si256(), s16 = _mm256_setzero_si256();
        for (int g = 0; g < quads; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * g + 32 * h));
            int32_t a0, a1;
            memcpy(&a0, a + 4 * g, 4);
            if (nib) {
                memcpy(&a1, a + 16 + 4 * g, 4);
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(v, mask), _mm256_set1_epi32(a0)));
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi32(v, 4), mask),
                                                                 _mm256_set1_epi32(a1)));
            } else {
                __m256i q = _mm256_xor_si256(v, bias);
                __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(_mm256_set1_epi32(a0), q));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
            }
        }
        out.h[h] = nib ? _mm256_madd_epi16(s16, ones) : acc;
    }
#endif
    return out;
}
ALWAYS void vi_store(int32_t *out, vi v) {
    _mm256_storeu_si256((__m256i *)out, v.h[0]);
    _mm256_storeu_si256((__m256i *)(out + 8), v.h[1]);
}
ALWAYS vf vf_zero(void) { vf z = {{_mm256_setzero_ps(), _mm256_setzero_ps()}}; return z; }
ALWAYS void vf_store(float *p, vf v) {
    _mm256_storeu_ps(p, v.h[0]);
    _mm256_storeu_ps(p + 8, v.h[1]);
}
/* 8 scales from p + 8h: half floats (F16C, exact), f32, or (half 2) integers (int8 where sgn, else
 * uint8) times their f32 super scales `sup` + 8h */
ALWAYS __m256 scales8(const void *p, const float *sup, int h, int half, int sgn) {
    if (half == 2) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)p + 8 * h));
        const __m256i i = sgn ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
        return _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_loadu_ps(sup + 8 * h));
    }
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + 8 * h)))
                : _mm256_loadu_ps((const float *)p + 8 * h);
}
ALWAYS vf vf_update(vf acc, const void *d, const float *ds, float s, vi dots, const void *m, const float *ms, float x,
                    int half, int mins) {
    const __m256 S = _mm256_set1_ps(s), X = _mm256_set1_ps(x);
    for (int h = 0; h < 2; h++) {
        const __m256 dv = scales8(d, ds, h, half, mins == 0);
        acc.h[h] = _mm256_add_ps(acc.h[h], _mm256_mul_ps(_mm256_mul_ps(dv, S), _mm256_cvtepi32_ps(dots.h[h])));
        if (mins) {
            const __m256 mv = mins == 2 ? _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f)) : scales8(m, ms, h, half, 0);
            acc.h[h] = _mm256_add_ps(acc.h[h], _mm256_mul_ps(mv, X));
        }
    }
    return acc;
}
#else
typedef struct { int32_t v[LANES]; } vi;
typedef struct { float v[LANES]; } vf;
ALWAYS vi unit_dot(const uint8_t *w, const int8_t *a, int quads, int nib, int32_t qa_sum, int six) {
    vi out;
    (void)qa_sum;
#if TS_PATH == 3
    const uint8x16_t mask = vdupq_n_u8(0x0F), bias = vdupq_n_u8(0x80);
    for (int k = 0; k < 4; k++) {
        int32x4_t acc = vdupq_n_s32(0);
        for (int g = 0; g < quads; g++) {
            uint8_t b[16];
            if (six)
                for (int e = 0; e < 16; e++) b[e] = six_byte(w, g, 16 * k + e);
            uint8x16_t v = vld1q_u8(six ? b : w + 64 * g + 16 * k);
            int32_t a0, a1;
            memcpy(&a0, a + 4 * g, 4);
            if (nib) {
                memcpy(&a1, a + 16 + 4 * g, 4);
                acc = vdotq_s32(acc, vreinterpretq_s8_u8(vandq_u8(v, mask)), vreinterpretq_s8_s32(vdupq_n_s32(a0)));
                acc = vdotq_s32(acc, vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), vreinterpretq_s8_s32(vdupq_n_s32(a1)));
            } else {
                acc = vdotq_s32(acc, vreinterpretq_s8_u8(veorq_u8(v, bias)), vreinterpretq_s8_s32(vdupq_n_s32(a0)));
            }
        }
        vst1q_s32(out.v + 4 * k, acc);
    }
#else
    for (int l = 0; l < LANES; l++) out.v[l] = 0;
    for (int g = 0; g < quads; g++) {
        const uint8_t *wg = w + 64 * g;
        for (int l = 0; l < LANES; l++) {
            int32_t t = 0;
            for (int e = 0; e < 4; e++) {
                int32_t v = six ? six_byte(w, g, 4 * l + e) : wg[4 * l + e];
                if (nib)
                    t += (v & 15) * a[4 * g + e] + (v >> 4) * a[16 + 4 * g + e];
                else
                    t += (v - 128) * a[4 * g + e];
            }
            out.v[l] += t;
        }
    }
#endif
    return out;
}
ALWAYS void vi_store(int32_t *out, vi v) { memcpy(out, v.v, sizeof(v.v)); }
ALWAYS vf vf_zero(void) { vf z; for (int l = 0; l < LANES; l++) z.v[l] = 0.0f; return z; }
ALWAYS void vf_store(float *p, vf v) { memcpy(p, v.v, sizeof(v.v)); }
/* scale l of p: a half float (converted exactly), f32, or (half 2) an integer (int8 where sgn, else
 * uint8) times its f32 super scale sup[l] */
ALWAYS float scale_at(const void *p, const float *sup, int l, int half, int sgn) {
    if (half == 2) return kscale(p, l, sgn, sup[l]);
    return half ? h2f(((const uint16_t *)p)[l]) : ((const float *)p)[l];
}
ALWAYS vf vf_update(vf acc, const void *d, const float *ds, float s, vi dots, const void *m, const float *ms, float x,
                    int half, int mins) {
    for (int l = 0; l < LANES; l++) acc.v[l] += (scale_at(d, ds, l, half, mins == 0) * s) * (float)dots.v[l];
    if (mins)
        for (int l = 0; l < LANES; l++)
            acc.v[l] += (mins == 2 ? scale_at(d, ds, l, half, 0) * -8.0f : scale_at(m, ms, l, half, 0)) * x;
    return acc;
}
#endif

/* sum(q_a) over the activations of the unit starting at k0 (`per` 32 or 16 wide), from one row's
 * half-block sums: what the VNNI paths take 128 times off a q8 unit's biased dot */
static inline int32_t unit_qsum(const int32_t *qsum_row, i64 k0, i64 per) {
    return qsum_row[k0 / 16] + (per == 32 ? qsum_row[k0 / 16 + 1] : 0);
}

/* bytes one output row of a unit takes in qv: q4 16 (32 nibbles), six 12 (16 weights in 6 bits,
 * NOTE(q6)), q8 `per`; a unit of a tile takes R times it, a chunk of 16 rows 16 times it */
static inline i64 unit_row_bytes(int mins, int six, i64 per) { return mins ? 16 : six ? 12 : per; }

/* The int8 product of rows i of tile t for NC chunks of 16 output rows at once (NC = R/16), every
 * chunk's 16 sums kept in registers across the units: per unit u and output row,
 * acc += (d_u * d_a) * dot, then for q4 acc += m_u * xs (the min term on the rounded activations:
 * int8.py, NOTE(accuracy)); units in order, so the bits do not depend on NC or the path. MINS as
 * ts_weight's; HALF as ts_weight's `half` (SZ bytes a scale; 2: super scales G units apart). */
#define TILE_ROWS(NC, QUADS, MINS, HALF, SIX)                                                                     \
    static void tile_##NC##_##QUADS##_##MINS##_##HALF##_##SIX(const ts_weight *w, i64 t, const int8_t *q,          \
                            const float *da, const float *xs, const int32_t *qsum, i64 B, float *y, i64 ldy, i64 c0) { \
        const i64 nu = w->nu, R = w->R, K = w->K, per = K / nu, step = R * unit_row_bytes(MINS, SIX, per);       \
        const i64 SZ = HALF == 2 ? 1 : HALF ? 2 : 4, chunk = 16 * unit_row_bytes(MINS, SIX, per);                \
        const i64 G = HALF == 2 ? w->group : 1;                                                                   \
        const char *d = (const char *)w->d, *m = (const char *)w->m;                                              \
        for (i64 i = 0; i < B; i++) {                                                                             \
            vf acc[NC];                                                                                           \
            _Pragma("GCC unroll 8") for (int c = 0; c < NC; c++) acc[c] = vf_zero();                              \
            for (i64 u = 0; u < nu; u++) {                                                                        \
                const i64 k0 = u * per;                                                                           \
                const uint8_t *base = w->qv + (t * nu + u) * step;                                                \
                const char *du = d + (t * nu + u) * R * SZ;                                                       \
                const char *mu = MINS == 1 ? m + (t * nu + u) * R * SZ : NULL;                                    \
                const i64 sup = (t * (nu / G) + u / G) * R;                                                       \
                const float *dsu = HALF == 2 ? w->ds + sup : NULL, *msu = HALF == 2 && MINS == 1 ? w->ms + sup : NULL; \
                const int8_t *a = q + i * K + k0;                                                                 \
                const int32_t qs = unit_qsum(qsum + i * (K / 16), k0, per);                                      \
                const float s = da[i * (K / 32) + k0 / 32], x = MINS ? xs[i * (K / 32) + u] : 0.0f;               \
                _Pragma("GCC unroll 8") for (int c = 0; c < NC; c++)                                              \
                    acc[c] = vf_update(acc[c], du + 16 * (c0 + c) * SZ, dsu ? dsu + 16 * (c0 + c) : NULL, s,          \
                                       unit_dot(base + (c0 + c) * chunk, a, QUADS, MINS != 0, qs, SIX),           \
                                       MINS == 1 ? mu + 16 * (c0 + c) * SZ : NULL, msu ? msu + 16 * (c0 + c) : NULL, \
                                       x, HALF, MINS);                                                            \
            }                                                                                                     \
            _Pragma("GCC unroll 8") for (int c = 0; c < NC; c++) vf_store(y + i * ldy + t * R + 16 * (c0 + c), acc[c]); \
        }                                                                                                         \
    }
#define TILE_HALVES(NC, QUADS, MINS) TILE_ROWS(NC, QUADS, MINS, 0, 0) TILE_ROWS(NC, QUADS, MINS, 1, 0)
/* K-quant scales (HALF 2): Q4_K (q4 with mins) and Q6_K (q8 in units of 16: 4 quads; SIX: in 6 bits) */
#define TILE_ALL(NC) TILE_HALVES(NC, 4, 1) TILE_HALVES(NC, 4, 2) TILE_HALVES(NC, 4, 0) TILE_HALVES(NC, 8, 0) \
    TILE_ROWS(NC, 4, 1, 2, 0) TILE_ROWS(NC, 4, 0, 2, 0) TILE_ROWS(NC, 4, 0, 2, 1)
TILE_ALL(1)
TILE_ALL(2)
TILE_ALL(4)
TILE_ALL(8)

typedef void (*tile_fn)(const ts_weight *, i64, const int8_t *, const float *, const float *, const int32_t *, i64,
                        float *, i64, i64);

static tile_fn tile_for(i64 nc, int quads, int mins, int half, int six) {
#define PICK_HALF(NC, QUADS, MINS) return half ? tile_##NC##_##QUADS##_##MINS##_1_0 : tile_##NC##_##QUADS##_##MINS##_0_0;
#define PICK(NC)                                                                                                   \
    if (nc == NC) {                                                                                                \
        if (six) return half == 2 && mins == 0 && quads == 4 ? tile_##NC##_4_0_2_1 : NULL;                         \
        if (half == 2) return mins == 1 ? tile_##NC##_4_1_2_0 : mins == 0 && quads == 4 ? tile_##NC##_4_0_2_0 : NULL; \
        if (mins == 1) PICK_HALF(NC, 4, 1)                                                                         \
        if (mins == 2) PICK_HALF(NC, 4, 2)                                                                         \
        if (quads == 4) PICK_HALF(NC, 4, 0)                                                                        \
        PICK_HALF(NC, 8, 0)                                                                                        \
    }
    PICK(1) PICK(2) PICK(4) PICK(8)
#undef PICK
#undef PICK_HALF
    return NULL;
}

/* PERF(k-scales-rows): from this many rows on, a product over K-quant scales (half 2) converts each
 * tile's scales and mins to f32 once (into `conv`, one slot per thread) and runs the f32 tile on them,
 * instead of converting them again for every row: the same products, bit for bit (NOTE(k-scales)). A
 * decode row reads the integers (fewer bytes) directly. */
#define CONVERT_ROWS 4

/* tile t's K-quant scales and mins as f32 [nu, R] each into buf (m after d) */
static void convert_tile(const ts_weight *w, i64 t, float *buf) {
    const i64 nu = w->nu, R = w->R, G = w->group, signs = w->mins == 0;
#if TS_PATH <= 2
    /* PERF(convert): 8 lanes at a time, the same int -> float -> times its super scale as kscale (the
     * compiler left the loop with mins scalar: 11% of a 16-row Q4_K product) */
    if (R % 8 == 0) {
        for (i64 u = 0; u < nu; u++) {
            const i64 at = (t * nu + u) * R, sup = (t * (nu / G) + u / G) * R;
            for (i64 r = 0; r < R; r += 8) {
                const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)w->d + at + r));
                const __m256i i = signs ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
                _mm256_storeu_ps(buf + u * R + r, _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_loadu_ps(w->ds + sup + r)));
                if (w->mins == 1) {
                    const __m128i mb = _mm_loadl_epi64((const __m128i *)((const uint8_t *)w->m + at + r));
                    _mm256_storeu_ps(buf + (nu + u) * R + r,
                                     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mb)), _mm256_loadu_ps(w->ms + sup + r)));
                }
            }
        }
        return;
    }
#endif
    for (i64 u = 0; u < nu; u++)
        for (i64 r = 0; r < R; r++) {
            const i64 at = (t * nu + u) * R + r, sup = (t * (nu / G) + u / G) * R + r;
            buf[u * R + r] = kscale(w->d, at, signs, w->ds[sup]);
            if (w->mins == 1) buf[(nu + u) * R + r] = kscale(w->m, at, 0, w->ms[sup]);
        }
}

/* tile t of a six weight (NOTE(q6)) widened to 8 bits into out, as a q8 weight in units of 16 holds
 * it (q + 128; [nu, R/16, 4 quads, 16, 4]): from 4 rows on a product runs the 8-bit tiles on it, the
 * unpacking paid once for every row (PERF(k-scales-rows)) */
static void widen_tile(const ts_weight *w, i64 t, uint8_t *out) {
    const i64 units = w->nu * (w->R / 16);
    const uint8_t *src = w->qv + t * units * 192;
    for (i64 k = 0; k < units; k++) {
        uint8_t *o = out + k * 256;
#if TS_PATH <= 2
        for (int h = 0; h < 2; h++) {
            __m256i v[4];
            six_quads256(src + k * 192, h, v);
            for (int g = 0; g < 4; g++)
                _mm256_storeu_si256((__m256i *)(o + 64 * g + 32 * h), _mm256_add_epi8(v[g], _mm256_set1_epi8(96)));
        }
#else
        for (int g = 0; g < 4; g++)
            for (int at = 0; at < 64; at++) o[64 * g + at] = six_byte(src + k * 192, g, at);
#endif
    }
}

/* floats a thread's `conv` slot holds for weights of up to K inputs and R lanes: the tile's scales
 * and mins in f32, then (NOTE(q6)) a tile widened to 8 bits */
static inline i64 conv_slot(i64 K, i64 R) { return 2 * (K / 16) * R + R * K / 4; }

#if TS_PATH == 2
/* PERF(rows-4): on AVX2 without VNNI the one-row tile is bound by its vector operations, a third of
 * them unpacking the weights' nibbles. From ROWS_AT_ONCE rows on, a tile runs 8 output rows at a time
 * against 4 activation rows: each unit's weights loaded and unpacked once for the 4 (q8: their signs
 * taken once), 4 accumulators kept in registers. Every row's sums are the one-row tile's, formed in
 * the same order (integer dots exact; the same float steps per unit), so the bits are unchanged. */
#define ROWS_AT_ONCE 4
/* x stays in a register where it is: the compiler would otherwise regroup the exact integer sums into
 * a tree of every product at once, more live vectors than AVX2 has, and spill them */
#define KEEP(x) __asm__("" : "+x"(x))
/* PERF(rows-ahead): a tile's passes read a unit's chunk c at a stride of the whole unit, so the first
 * pass (chunk 0, half 0, rows 0-3) asks for all of the unit this many units ahead: a decode step of
 * 4 rows, its weights streamed from memory, 70 -> 65 ms on the 1B Q4_K_M (Zen 3); 8 rows ~2% */
#define ROWS_AHEAD 4
ALWAYS void rows_half(const ts_weight *w, i64 t, const int8_t *q, const float *da, const float *xs, i64 i0,
                      const int NR, float *y, i64 ldy, i64 c, int h, const int quads, const int mins, const int half,
                      const int narrow) {
    const i64 nu = w->nu, R = w->R, K = w->K, per = K / nu, step = R * unit_row_bytes(mins, 0, per);
    const i64 SZ = half ? 2 : 4, chunk = 16 * unit_row_bytes(mins, 0, per);
    const char *d = (const char *)w->d, *m = (const char *)w->m;
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
    __m256 acc[4];
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[j] = _mm256_setzero_ps();
    for (i64 u = 0; u < nu; u++) {
        const i64 k0 = u * per;
        const uint8_t *wu = w->qv + (t * nu + u) * step + c * chunk + 32 * h;
        if (c == 0 && h == 0 && i0 == 0 && u + ROWS_AHEAD < nu)
            for (i64 l = 0; l < step; l += 64)
                _mm_prefetch((const char *)(w->qv + (t * nu + u + ROWS_AHEAD) * step + l), _MM_HINT_T0);
        const int8_t *a = q + i0 * K + k0;
        __m256i dots[4];
        if (mins) {
            __m256i s16[4];
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) s16[j] = _mm256_setzero_si256();
            _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wu + 64 * g));
                const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi32(v, 4), mask);
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {
                    int32_t a0, a1;
                    memcpy(&a0, a + j * K + 4 * g, 4);
                    memcpy(&a1, a + j * K + 16 + 4 * g, 4);
                    s16[j] = _mm256_add_epi16(s16[j], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a0)));
                    s16[j] = _mm256_add_epi16(s16[j], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a1)));
                    KEEP(s16[j]);
                }
            }
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) dots[j] = _mm256_madd_epi16(s16[j], ones);
        } else {
            /* PERF(narrow): a tile widened from 6 bits holds |q| <= 32, so a pair is <= 2 * 32 * 127 and
             * a unit's 4 quads add up in int16 (<= 32512) before one vpmaddwd, where q8 widens each */
            __m256i s16[4];
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) dots[j] = s16[j] = _mm256_setzero_si256();
            _Pragma("GCC unroll 8") for (int g = 0; g < quads; g++) {
                const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wu + 64 * g)), bias);
                const __m256i mag = _mm256_sign_epi8(v, v);
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {
                    int32_t a0;
                    memcpy(&a0, a + j * K + 4 * g, 4);
                    const __m256i p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(_mm256_set1_epi32(a0), v));
                    if (narrow) {
                        s16[j] = _mm256_add_epi16(s16[j], p);
                        KEEP(s16[j]);
                    } else {
                        dots[j] = _mm256_add_epi32(dots[j], _mm256_madd_epi16(p, ones));
                        KEEP(dots[j]);
                    }
                }
            }
            if (narrow) _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) dots[j] = _mm256_madd_epi16(s16[j], ones);
        }
        const char *du = d + ((t * nu + u) * R + 16 * c) * SZ;
        const __m256 dv = scales8(du, NULL, h, half, mins == 0);
        const __m256 mv = mins == 2 ? _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f))
                        : mins == 1 ? scales8(m + ((t * nu + u) * R + 16 * c) * SZ, NULL, h, half, 0) : dv;
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {
            const i64 at = (i0 + j) * (K / 32);
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(_mm256_mul_ps(dv, _mm256_set1_ps(da[at + k0 / 32])),
                                                         _mm256_cvtepi32_ps(dots[j])));
            if (mins) acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(mv, _mm256_set1_ps(xs[at + u])));
        }
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)
        _mm256_storeu_ps(y + (i0 + j) * ldy + t * R + 16 * c + 8 * h, acc[j]);
}

/* tile t of w (scales as half floats or f32, never K-quant integers) for all B rows, 4 at a time;
 * NARROW: a q8 tile widened from 6 bits (PERF(narrow)) */
#define ROWS_KIND(QUADS, MINS, HALF, NARROW)                                                                  \
    static void rows_##QUADS##_##MINS##_##HALF##_##NARROW(const ts_weight *w, i64 t, const int8_t *q,          \
                                                         const float *da, const float *xs, i64 B, float *y, i64 ldy) { \
        for (i64 c = 0; c < w->R / 16; c++)                                                                   \
            for (int h = 0; h < 2; h++) {                                                                     \
                i64 i0 = 0;                                                                                   \
                for (; i0 + 4 <= B; i0 += 4) rows_half(w, t, q, da, xs, i0, 4, y, ldy, c, h, QUADS, MINS, HALF, NARROW); \
                switch (B - i0) {                                                                             \
                case 3: rows_half(w, t, q, da, xs, i0, 3, y, ldy, c, h, QUADS, MINS, HALF, NARROW); break;    \
                case 2: rows_half(w, t, q, da, xs, i0, 2, y, ldy, c, h, QUADS, MINS, HALF, NARROW); break;    \
                case 1: rows_half(w, t, q, da, xs, i0, 1, y, ldy, c, h, QUADS, MINS, HALF, NARROW); break;    \
                default: break;                                                                               \
                }                                                                                             \
            }                                                                                                 \
    }
#define ROWS_HALVES(QUADS, MINS) ROWS_KIND(QUADS, MINS, 0, 0) ROWS_KIND(QUADS, MINS, 1, 0)
ROWS_HALVES(4, 1) ROWS_HALVES(4, 2) ROWS_HALVES(4, 0) ROWS_HALVES(8, 0) ROWS_KIND(4, 0, 0, 1)

typedef void (*rows_fn)(const ts_weight *, i64, const int8_t *, const float *, const float *, i64, float *, i64);

static rows_fn rows_for(int quads, int mins, int half, int narrow) {
    if (half == 2) return NULL;
    if (narrow) return quads == 4 && mins == 0 && half == 0 ? rows_4_0_0_1 : NULL;
#define PICK_ROWS(QUADS, MINS) return half ? rows_##QUADS##_##MINS##_1_0 : rows_##QUADS##_##MINS##_0_0;
    if (mins == 1) PICK_ROWS(4, 1)
    if (mins == 2) PICK_ROWS(4, 2)
    if (quads == 4) PICK_ROWS(4, 0)
    if (quads == 8) PICK_ROWS(8, 0)
#undef PICK_ROWS
    return NULL;
}
#endif

/* y [B, T*R] (row stride ldy) = the quantized rows (q, da, xs, qsum as ts_quantize_rows fills them)
 * times weight w; `conv`: conv_slot(K, R) floats per thread where B >= CONVERT_ROWS and w has K-quant
 * scales (PERF(k-scales-rows), NOTE(q6)), else unused. */
static void matmul_i8(const ts_weight *w, const int8_t *q, const float *da, const float *xs, const int32_t *qsum,
                      i64 B, float *y, i64 ldy, int nthreads, float *conv) {
    const i64 T = w->T, R = w->R, nu = w->nu, per = w->K / nu;
    const i64 step = R * unit_row_bytes((int)w->mins, (int)w->six, per);
    const int mins = (int)w->mins, half = (int)w->half, quads = mins ? 4 : (int)(per / 4);
    const int convert = half == 2 && B >= CONVERT_ROWS && conv != NULL;
    int nt = threads_for(nthreads, T);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (i64 t = 0; t < T; t++) {
        ts_weight one = *w;
        i64 at = t;
        if (convert) {                     /* tile t alone, its scales in f32: the f32 tile's input */
            float *buf = conv + (i64)omp_get_thread_num() * conv_slot(w->K, R);
            convert_tile(w, t, buf);
            one.qv = w->qv + t * nu * step, one.d = buf, one.m = mins == 1 ? buf + nu * R : NULL;
            one.T = 1, one.half = 0, at = 0;
            if (w->six) {
                uint8_t *wide = (uint8_t *)(buf + 2 * nu * R);
                widen_tile(w, t, wide);
                one.qv = wide, one.six = 0;
            }
        }
        float *yt = y + (convert ? t * R : 0);
#if TS_PATH == 2
        const rows_fn rows = B >= ROWS_AT_ONCE ? rows_for(quads, mins, (int)one.half, (int)(w->six && convert)) : NULL;
        if (rows != NULL) {
            rows(&one, at, q, da, xs, B, yt, ldy);
            continue;
        }
#endif
        for (i64 c0 = 0, nc; c0 < R / 16; c0 += nc) {      /* chunks 8, 4, 2 or 1 at a time */
            nc = R / 16 - c0 >= 8 ? 8 : R / 16 - c0 >= 4 ? 4 : R / 16 - c0 >= 2 ? 2 : 1;
            tile_for(nc, quads, mins, (int)one.half, (int)one.six)(&one, at, q, da, xs, qsum, B, yt, ldy, c0);
        }
    }
}

/* the integer dots alone, for tests: dots [B, T, nu, R] int32 (the plain signed sums) */
void ts_unit_dots(const ts_weight *w, const int8_t *q, const int32_t *qsum, i64 B, int32_t *out) {
    const i64 T = w->T, nu = w->nu, R = w->R, K = w->K, per = K / nu;
    const int nib = w->mins != 0, quads = nib ? 4 : (int)(per / 4), six = (int)w->six;
    const i64 step = R * unit_row_bytes(nib, six, per), chunk = 16 * unit_row_bytes(nib, six, per);
    for (i64 i = 0; i < B; i++)
        for (i64 t = 0; t < T; t++)
            for (i64 u = 0; u < nu; u++) {
                const i64 k0 = u * per;
                const int32_t qs = unit_qsum(qsum + i * (K / 16), k0, per);
                for (i64 c = 0; c < R / LANES; c++)
                    vi_store(out + ((i * T + t) * nu + u) * R + c * LANES,
                             unit_dot(w->qv + (t * nu + u) * step + c * chunk, q + i * K + k0, quads, nib, qs, six));
            }
}

/* ts_product_i8's buffers for B rows of up to K inputs: the rows quantized (ts_quantize_rows), and
 * where K-quant weights of up to R lanes take part (R > 0) a tile's f32 scales per thread
 * (PERF(k-scales-rows)) and room for a tile widened from 6 bits (NOTE(q6)) */
typedef struct {
    int8_t *q;
    float *da, *xs;
    int32_t *qsum;
    float *conv;
} product_bufs;

static void product_layout(cut *c, i64 B, i64 K, i64 R, int nthreads, product_bufs *s) {
    s->q = (int8_t *)take(c, B * K, 1);
    s->da = (float *)take(c, B * (K / 32), sizeof(float));
    s->xs = (float *)take(c, B * (K / 32), sizeof(float));
    s->qsum = (int32_t *)take(c, B * (K / 16), sizeof(int32_t));
    s->conv = B >= CONVERT_ROWS && R > 0 ? (float *)take(c, (i64)threads_for(nthreads, nthreads) * conv_slot(K, R),
                                                sizeof(float)) : NULL;
}

/* y [B, N] (N the parts' outputs together) = x [B, K] times the n parts of one product, the rows
 * quantized once for them all */
static void parts_i8(const float *x, i64 B, const ts_weight *w, i64 n, float *y, int nthreads, const product_bufs *s) {
    i64 N = 0;
    for (i64 j = 0; j < n; j++) N += w[j].T * w[j].R;
    ts_quantize_rows(x, B, w[0].K, s->q, s->da, s->xs, s->qsum, nthreads);
    for (i64 j = 0, col = 0; j < n; col += w[j].T * w[j].R, j++)
        matmul_i8(&w[j], s->q, s->da, s->xs, s->qsum, B, y + col, N, nthreads, s->conv);
}

/* y [B, T*R] = x [B, K] times w, x's rows quantized to int8 per block of 32 */
int ts_product_i8(const float *x, i64 B, const ts_weight *w, float *y, int nthreads) {
    product_bufs s;
    cut c = {NULL, 0, 0};
    const i64 lanes = w->half == 2 ? w->R : 0;
    product_layout(&c, B, w->K, lanes, nthreads, &s);
    if (scratch_begin(&c) != TS_OK) return TS_NOMEM;
    product_layout(&c, B, w->K, lanes, nthreads, &s);
    parts_i8(x, B, w, 1, y, nthreads, &s);
    return TS_OK;
}

/* ---- float activations (cpu.py's fused kernels and the BLAS path's dequantizers) ------------ */

/* A weight in the float kernels' tiled layout (quant.QWeight): q4: qs u8 [T, K/32, 16, R], d, m
 * [T, K/32, R]; q8: qs i8 [T, K/16, 16, R], d [T, nd, R] (K/16/nd sub-blocks per scale), m NULL. */
typedef struct {
    const void *qs;
    const float *d;
    const float *m;
    i64 T, nb, nd, R, K;
} ts_fweight;

/* one thread's buffers in ts_product_f32: acc [B, R], wt [32, R], s [R] */
typedef struct { float *acc, *wt, *s; } f32_bufs;

static f32_bufs f32_slot(cut *c, i64 B, i64 R) {
    f32_bufs b;
    b.acc = (float *)take(c, B * R, sizeof(float));
    b.wt = (float *)take(c, 32 * R, sizeof(float));
    b.s = (float *)take(c, R, sizeof(float));
    return b;
}

/* y [B, T*R] = x [B, K] times w in float32: per block, w unpacked once into a float tile [32 or 16, R]
 * all rows reuse; per row and output row s = sum_j w[j] x[j] in j order, acc += d * s (+ m * sum(x)
 * for q4, the block's sum of x in j order). */
int ts_product_f32(const float *x, i64 B, const ts_fweight *w, float *y, int nthreads) {
    const i64 T = w->T, nb = w->nb, R = w->R, K = w->K;
    const int q4 = w->m != NULL;
    const i64 S = 16, per = q4 ? 32 : 16, g = q4 ? 1 : nb / w->nd;
    int nt = threads_for(nthreads, T);
    cut one = {NULL, 0, 0};
    f32_slot(&one, B, R);
    cut c = {NULL, 0, one.bad};
    take(&c, nt, one.used);
    if (scratch_begin(&c) != TS_OK) return TS_NOMEM;
    char *slots = (char *)take(&c, nt, one.used);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        cut mine = {slots + (size_t)omp_get_thread_num() * one.used, 0, 0};
        const f32_bufs b = f32_slot(&mine, B, R);
        float *acc = b.acc, *wt = b.wt, *s = b.s;
#pragma omp for schedule(static)
        for (i64 t = 0; t < T; t++) {
            memset(acc, 0, sizeof(float) * (size_t)(B * R));
            for (i64 b = 0; b < nb; b++) {
                const i64 k = b * per;
                if (q4) {
                    const uint8_t *qb = (const uint8_t *)w->qs + (t * nb + b) * S * R;
                    for (i64 j = 0; j < S; j++)
                        for (i64 r = 0; r < R; r++) {
                            wt[j * R + r] = (float)(qb[j * R + r] & 15);
                            wt[(16 + j) * R + r] = (float)(qb[j * R + r] >> 4);
                        }
                } else {
                    const int8_t *qb = (const int8_t *)w->qs + (t * nb + b) * S * R;
                    for (i64 j = 0; j < S * R; j++) wt[j] = (float)qb[j];
                }
                const float *db = w->d + (t * w->nd + b / g) * R;
                const float *mb = q4 ? w->m + (t * nb + b) * R : NULL;
                for (i64 i = 0; i < B; i++) {
                    const float *xi = x + i * K + k;
                    float *ai = acc + i * R;
                    for (i64 r = 0; r < R; r++) s[r] = 0.0f;
                    for (i64 j = 0; j < per; j++) {
                        const float xj = xi[j], *wj = wt + j * R;
                        for (i64 r = 0; r < R; r++) s[r] += wj[r] * xj;
                    }
                    if (q4) {
                        float xsum = 0.0f;
                        for (i64 j = 0; j < 32; j++) xsum += xi[j];
                        for (i64 r = 0; r < R; r++) ai[r] += db[r] * s[r] + mb[r] * xsum;
                    } else {
                        for (i64 r = 0; r < R; r++) ai[r] += db[r] * s[r];
                    }
                }
            }
            for (i64 i = 0; i < B; i++) memcpy(y + i * T * R + t * R, acc + i * R, sizeof(float) * (size_t)R);
        }
    }
    return TS_OK;
}

/* tiles t0.. of w -> out [K, cols] float32 (W.T), cols a multiple of R */
void ts_dequant_t(const ts_fweight *w, i64 t0, float *out, i64 cols, int nthreads) {
    const i64 nb = w->nb, R = w->R, S = 16;
    const int q4 = w->m != NULL;
    const i64 g = q4 ? 1 : nb / w->nd, tiles = cols / R;
    int nt = threads_for(nthreads, tiles);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (i64 tt = 0; tt < tiles; tt++) {
        const i64 t = t0 + tt, c = tt * R;
        for (i64 b = 0; b < nb; b++) {
            const float *db = w->d + (t * w->nd + b / g) * R;
            if (q4) {
                const uint8_t *qb = (const uint8_t *)w->qs + (t * nb + b) * S * R;
                const float *mb = w->m + (t * nb + b) * R;
                for (i64 j = 0; j < S; j++) {
                    float *lo = out + (b * 32 + j) * cols + c, *hi = out + (b * 32 + 16 + j) * cols + c;
                    for (i64 r = 0; r < R; r++) {
                        lo[r] = (float)(qb[j * R + r] & 15) * db[r] + mb[r];
                        hi[r] = (float)(qb[j * R + r] >> 4) * db[r] + mb[r];
                    }
                }
            } else {
                const int8_t *qb = (const int8_t *)w->qs + (t * nb + b) * S * R;
                for (i64 j = 0; j < S; j++) {
                    float *o = out + (b * S + j) * cols + c;
                    for (i64 r = 0; r < R; r++) o[r] = (float)qb[j * R + r] * db[r];
                }
            }
        }
    }
}

/* ---- attention (attention.py) ---------------------------------------------------------------- */

/* The KV caches of a call: kv [S, 3] (K address, V address, capacity), buffers [n_layer, capacity,
 * G, row] whose rows hold one KV head's D values as `kind` says: KV_F32 float32, KV_F16 half floats
 * (bits), KV_Q8 GGUF's q8_0 numbers (NOTE(kv-q8)). */
#define KV_F32 0
#define KV_F16 1
#define KV_Q8 2
typedef struct {
    const i64 *kv;
    int kind;
    i64 li, G, D;
} kvset;

/* NOTE(kv-q8): a q8_0 row is D int8 values, then D/32 half-float scales, one per 32 values (D a
 * multiple of 32): value d is q[d] * scale[d / 32], a product exact in float32 (11 by 8 significant
 * bits), so attention over q8_0 rows computes what it computes over float32 rows holding those
 * values, bit for bit. A block's scale is the half float nearest amax / 127 and q = rint(x / scale)
 * (ties to even) held to +-127; 0 where the scale is 0. 34 bytes for 32 values, as the file format
 * and llama.cpp's -ctk/-ctv q8_0 (which multiplies by 1/scale and rounds ties away from zero: a
 * value may land one step apart there). */
static inline i64 row_bytes(int kind, i64 D) { return kind == KV_Q8 ? D + D / 16 : D * (kind == KV_F16 ? 2 : 4); }

static inline float q8_scale(const void *row, i64 D, i64 d) {
    uint16_t h;
    memcpy(&h, (const char *)row + D + 2 * (d / 32), 2);
    return h2f(h);
}

/* the q8_0 row of D values x at out (NOTE(kv-q8)) */
void ts_quantize_kv(const float *x, i64 D, int8_t *out) {
    for (i64 b = 0; b < D / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int e = 0; e < 32; e++) amax = fabsf(xb[e]) > amax ? fabsf(xb[e]) : amax;
        const uint16_t h = f2h(amax / 127.0f);
        const float d = h2f(h);
        for (int e = 0; e < 32; e++) {
            const float r = d > 0.0f ? rintf(xb[e] / d) : 0.0f;
            out[32 * b + e] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
        memcpy(out + D + 2 * b, &h, 2);
    }
}

static inline const void *kv_row(const kvset *c, i64 s, int which, i64 j, i64 g) {
    const i64 cap = c->kv[s * 3 + 2];
    const char *base = (const char *)(intptr_t)c->kv[s * 3 + which];
    return base + ((c->li * cap + j) * c->G + g) * row_bytes(c->kind, c->D);
}

static inline float elem(const void *row, int kind, i64 D, i64 d) {
    if (kind == KV_Q8) return (float)((const int8_t *)row)[d] * q8_scale(row, D, d);
    return kind == KV_F16 ? h2f(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

static inline void prefetch_row(const void *row, i64 bytes) {
    for (i64 line = 0; line < bytes; line += 64) __builtin_prefetch((const char *)row + line, 0, 3);
}

#if defined(__AVX512F__)
/* 16 values of a row from d on (d a multiple of 16), as float32 */
static inline __m512 load16(const void *k, int kind, i64 D, i64 d) {
    if (kind == KV_Q8)
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)k + d)))),
                             _mm512_set1_ps(q8_scale(k, D, d)));
    return kind == KV_F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)k + d)))
                          : _mm512_loadu_ps((const float *)k + d);
}
#elif defined(__AVX2__) && defined(__F16C__)
/* 8 values of a row from d on (d a multiple of 8), as float32 */
static inline __m256 load8(const void *k, int kind, i64 D, i64 d) {
    if (kind == KV_Q8)
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)k + d)))),
                             _mm256_set1_ps(q8_scale(k, D, d)));
    return kind == KV_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)k + d)))
                          : _mm256_loadu_ps((const float *)k + d);
}
#endif

/* q . k over D, in 16 lanes (lane d % 16) then a fixed tree */
static inline float dot_row(const float *q, const void *k, int kind, i64 D) {
    float l[LANES];
    i64 d = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; d + 16 <= D; d += 16) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + d), load16(k, kind, D, d)));
    if (d == D) return hsum512(acc);
    _mm512_storeu_ps(l, acc);
#elif defined(__AVX2__) && defined(__F16C__)
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; d + 16 <= D; d += 16) {
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(q + d), load8(k, kind, D, d)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(q + d + 8), load8(k, kind, D, d + 8)));
    }
    if (d == D) return hsum256x2(a0, a1);
    _mm256_storeu_ps(l, a0);
    _mm256_storeu_ps(l + 8, a1);
#else
    for (int x = 0; x < LANES; x++) l[x] = 0.0f;
    for (; d + 16 <= D; d += 16)
        for (int x = 0; x < LANES; x++) l[x] += q[d + x] * elem(k, kind, D, d + x);
#endif
    for (i64 e = d; e < D; e++) l[e - d] += q[e] * elem(k, kind, D, e);
    return lanes_total(l);
}

/* o[D] = e0 v0 + ... as o += (e0 v0 + e1 v1) + (e2 v2 + e3 v3) */
#define ADD4(N, W, P, LD)                                                                                     \
    if (kind != KV_F32) {                                                                                       \
        W E0 = P##_set1_ps(e[0]), E1 = P##_set1_ps(e[1]), E2 = P##_set1_ps(e[2]), E3 = P##_set1_ps(e[3]);       \
        for (; d + N <= D; d += N) {                                                                            \
            W s = P##_add_ps(P##_add_ps(P##_mul_ps(E0, LD(v[0], kind, D, d)), P##_mul_ps(E1, LD(v[1], kind, D, d))), \
                             P##_add_ps(P##_mul_ps(E2, LD(v[2], kind, D, d)), P##_mul_ps(E3, LD(v[3], kind, D, d)))); \
            P##_storeu_ps(o + d, P##_add_ps(P##_loadu_ps(o + d), s));                                           \
        }                                                                                                       \
    }
static inline void add4(float *o, const void *const *v, const float *e, int kind, i64 D) {
    i64 d = 0;
#if defined(__AVX512F__)
    ADD4(16, __m512, _mm512, load16)
#elif defined(__AVX2__) && defined(__F16C__)
    ADD4(8, __m256, _mm256, load8)
#endif
    if (kind != KV_F32) {
        for (; d < D; d++)
            o[d] += (e[0] * elem(v[0], kind, D, d) + e[1] * elem(v[1], kind, D, d)) +
                    (e[2] * elem(v[2], kind, D, d) + e[3] * elem(v[3], kind, D, d));
    } else {
        const float *v0 = v[0], *v1 = v[1], *v2 = v[2], *v3 = v[3];
        for (; d < D; d++) o[d] += (e[0] * v0[d] + e[1] * v1[d]) + (e[2] * v2[d] + e[3] * v3[d]);
    }
}

/* the keys a..b-1 of chunk j0..j1-1 that the row at position p reads */
static inline void span(i64 p, i64 window, i64 j0, i64 j1, i64 *a, i64 *b) {
    i64 lo = window > 0 ? (p - window + 1 > 0 ? p - window + 1 : 0) : 0;
    *a = lo > j0 ? lo : j0;
    *b = p + 1 < j1 ? p + 1 : j1;
}

/* one query vector over keys a..b-1 (a < b) of KV head g of sequence s: o = sum e v,
 * *best = the highest score, returns sum e */
static float vector(const float *qv, const kvset *c, i64 s, i64 g, i64 a, i64 b, float *sc, float *o, float *best) {
    const i64 D = c->D, bytes = row_bytes(c->kind, D), stride = c->G * bytes;
    /* key j's row at kb + j * stride (prefetching past the buffer's end never faults) */
    const char *kb = (const char *)kv_row(c, s, 0, 0, g), *vb = (const char *)kv_row(c, s, 1, 0, g);
    for (i64 j = a; j < b; j++) {
        prefetch_row(kb + (j + AHEAD) * stride, bytes);
        sc[j - a] = dot_row(qv, kb + j * stride, c->kind, D);
    }
    float m = sc[0];
    for (i64 j = 1; j < b - a; j++) m = sc[j] > m ? sc[j] : m;
    exp_shifted(sc, b - a, m);
    for (i64 d = 0; d < D; d++) o[d] = 0.0f;
    i64 j = a;
    for (; j + 4 <= b; j += 4) {
        for (int x = 0; x < 4; x++) prefetch_row(vb + (j + AHEAD + x) * stride, bytes);
        const void *v[4] = {vb + j * stride, vb + (j + 1) * stride, vb + (j + 2) * stride, vb + (j + 3) * stride};
        add4(o, v, sc + (j - a), c->kind, D);
    }
    for (; j < b; j++) {
        const void *vj = vb + j * stride;
        const float e = sc[j - a];
        for (i64 d = 0; d < D; d++) o[d] += e * elem(vj, c->kind, D, d);
    }
    float l[LANES];
    for (int x = 0; x < LANES; x++) l[x] = 0.0f;
    for (i64 x = 0; x < b - a; x++) l[x % LANES] += sc[x];
    *best = m;
    return lanes_total(l);
}

typedef struct {
    const float *q;       /* [R, ldq]: row r's query head h at q + r*ldq + h*D, pre-scaled, rotated */
    i64 ldq;
    const i64 *seq, *pos;
    i64 window, H;
    kvset c;
} attn;

/* the partial (o [n, D], m, t) of block rows r0..r1-1 over chunk keys j0..j1-1 of KV head g */
static void partial(const attn *A, i64 r0, i64 r1, i64 g, i64 j0, i64 j1, float *o, float *m, float *t, float *sc) {
    const i64 M = A->H / A->c.G, D = A->c.D;
    for (i64 i = 0; i < (r1 - r0) * M; i++) {
        const i64 r = r0 + i / M, h = g * M + i % M;
        i64 a, b;
        span(A->pos[r], A->window, j0, j1, &a, &b);
        if (a >= b) {
            m[i] = EMPTY;
            t[i] = 0.0f;
            for (i64 d = 0; d < D; d++) o[i * D + d] = 0.0f;
        } else {
            t[i] = vector(A->q + r * A->ldq + h * D, &A->c, A->seq[r], g, a, b, sc, o + i * D, &m[i]);
        }
    }
}

static void merge(float *o, float *m, float *t, const float *oc, const float *mc, const float *tc, i64 n, i64 D) {
    for (i64 i = 0; i < n; i++) {
        if (mc[i] == EMPTY) continue;
        if (m[i] == EMPTY) {
            m[i] = mc[i];
            t[i] = tc[i];
            for (i64 d = 0; d < D; d++) o[i * D + d] = oc[i * D + d];
            continue;
        }
        const float best = m[i] > mc[i] ? m[i] : mc[i];
        const float a = ts_exp(m[i] - best), b = ts_exp(mc[i] - best);
        m[i] = best;
        t[i] = t[i] * a + tc[i] * b;
        for (i64 d = 0; d < D; d++) o[i * D + d] = o[i * D + d] * a + oc[i * D + d] * b;
    }
}

typedef struct { i64 r0, r1, c0, nc; } block;

/* one thread's working floats in attention: sc [CHUNK] (a chunk's scores), then block_head's o, m, t
 * and oc, mc, tc for up to N = ROWS * (H / G) query vectors */
static inline i64 attend_slot(i64 N, i64 D) {
    return (i64)(lines(sizeof(float) * (size_t)(CHUNK + 2 * N * D + 4 * N)) / sizeof(float));
}

/* block b's rows for KV head g into out [R, H*D]: from the partials at po/pm/pt + task*stride.. (task
 * >= 0), or else computed chunk by chunk here, each merged as it comes; `work` one thread's slot */
static void block_head(const attn *A, const block *bl, i64 g, const float *po, const float *pm, const float *pt,
                       i64 task, float *out, float *work) {
    const i64 M = A->H / A->c.G, D = A->c.D, n = (bl->r1 - bl->r0) * M, N = ROWS * M;
    float *sc = work, *o = sc + CHUNK, *m = o + N * D, *t = m + N;
    for (i64 i = 0; i < n; i++) m[i] = EMPTY;
    if (task >= 0) {
        for (i64 c = 0; c < bl->nc; c++)
            merge(o, m, t, po + (task + c) * N * D, pm + (task + c) * N, pt + (task + c) * N, n, D);
    } else {
        float *oc = t + N, *mc = oc + N * D, *tc = mc + N;
        for (i64 c = bl->c0; c < bl->c0 + bl->nc; c++) {
            partial(A, bl->r0, bl->r1, g, c * CHUNK, (c + 1) * CHUNK, oc, mc, tc, sc);
            merge(o, m, t, oc, mc, tc, n, D);
        }
    }
    for (i64 i = 0; i < n; i++) {
        const i64 r = bl->r0 + i / M, h = g * M + i % M;
        const float inv = 1.0f / t[i];
        for (i64 d = 0; d < D; d++) out[r * A->H * D + h * D + d] = o[i * D + d] * inv;
    }
}

/* rows 0..R-1 cut into blocks (up to ROWS rows of one sequence each, each with the chunks its rows
 * read) into bl where not NULL; returns their number, *chunks their chunks in all */
static i64 plan_blocks(const i64 *seq, const i64 *pos, i64 R, i64 window, block *bl, i64 *chunks) {
    i64 nb = 0;
    *chunks = 0;
    for (i64 r = 0; r < R;) {
        i64 e = r + 1;
        while (e < R && e - r < ROWS && seq[e] == seq[r]) e++;
        i64 c0 = (i64)1 << 62, c1 = 0;
        for (i64 x = r; x < e; x++) {
            i64 a, b;
            span(pos[x], window, 0, pos[x] + 1, &a, &b);
            c0 = a / CHUNK < c0 ? a / CHUNK : c0;
            c1 = (b - 1) / CHUNK > c1 ? (b - 1) / CHUNK : c1;
        }
        if (bl) {
            bl[nb].r0 = r;
            bl[nb].r1 = e;
            bl[nb].c0 = c0;
            bl[nb].nc = c1 - c0 + 1;
        }
        *chunks += c1 - c0 + 1;
        nb++;
        r = e;
    }
    return nb;
}

/* ts_attend_rows's buffers: blocks bl [nb], first [nb + 1] (each block's first task, in blocks'
 * tasks), the partials po [tasks, N, D], pm, pt [tasks, N] where spread, and nt threads' slots of
 * `per` floats at work */
typedef struct {
    i64 nb, tasks, per;
    int spread, nt;
    block *bl;
    i64 *first;
    float *po, *pm, *pt, *work;
} attend_bufs;

static void attend_layout(cut *c, const i64 *seq, const i64 *pos, i64 R, i64 window, i64 H, i64 G, i64 D, int nthreads,
                          attend_bufs *s) {
    i64 chunks;
    const i64 N = ROWS * (H / G);
    s->nb = plan_blocks(seq, pos, R, window, NULL, &chunks);
    s->spread = s->nb * G < SPREAD_BELOW;
    s->tasks = G * (s->spread ? chunks : s->nb);
    s->nt = threads_for(nthreads, s->tasks);
    s->per = attend_slot(N, D);
    s->bl = (block *)take(c, s->nb, sizeof(block));
    s->first = (i64 *)take(c, s->nb + 1, sizeof(i64));
    s->po = s->pm = s->pt = NULL;
    if (s->spread) {
        s->po = (float *)take(c, s->tasks * N * D, sizeof(float));
        s->pm = (float *)take(c, s->tasks * N, sizeof(float));
        s->pt = (float *)take(c, s->tasks * N, sizeof(float));
    }
    s->work = (float *)take(c, s->nt * s->per, sizeof(float));
}

static void attend_rows(const attn *A, i64 R, float *out, const attend_bufs *s) {
    const i64 G = A->c.G, N = ROWS * (A->H / G), D = A->c.D, nb = s->nb, tasks = s->tasks;
    const int spread = s->spread, nt = s->nt;
    block *bl = s->bl;
    i64 *first = s->first, chunks;
    plan_blocks(A->seq, A->pos, R, A->window, bl, &chunks);
    first[0] = 0;
    for (i64 b = 0; b < nb; b++) first[b + 1] = first[b] + (spread ? bl[b].nc : 1);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *work = s->work + (i64)omp_get_thread_num() * s->per;
        i64 b = 0;
#pragma omp for schedule(dynamic, 1)
        for (i64 x = 0; x < tasks; x++) {
            while (G * first[b + 1] <= x) b++;         /* tasks are in block order */
            while (G * first[b] > x) b--;
            const i64 nc = spread ? bl[b].nc : 1, g = (x - G * first[b]) / nc, c = (x - G * first[b]) % nc;
            if (spread)
                partial(A, bl[b].r0, bl[b].r1, g, (bl[b].c0 + c) * CHUNK, (bl[b].c0 + c + 1) * CHUNK, s->po + x * N * D,
                        s->pm + x * N, s->pt + x * N, work);
            else
                block_head(A, &bl[b], g, NULL, NULL, NULL, -1, out, work);
        }
    }
    if (spread)
        for (i64 bg = 0; bg < nb * G; bg++) {
            const i64 b = bg / G, g = bg % G;
            block_head(A, &bl[b], g, s->po, s->pm, s->pt, G * first[b] + g * bl[b].nc, out, s->work);
        }
}

/* out [R, H*D]: row r's query heads at position pos[r] of sequence seq[r] over its keys lo..pos[r] of
 * layer li (lo = pos[r] - window + 1, or 0); query head h reads KV head h / (H/G) */
int ts_attend_rows(const float *q, i64 ldq, i64 R, const i64 *seq, const i64 *pos, const i64 *kv, int kind, i64 li,
                   i64 window, i64 H, i64 G, i64 D, float *out, int nthreads) {
    attn A = {q, ldq, seq, pos, window, H, {kv, kind, li, G, D}};
    attend_bufs s;
    cut c = {NULL, 0, 0};
    attend_layout(&c, seq, pos, R, window, H, G, D, nthreads, &s);
    if (scratch_begin(&c) != TS_OK) return TS_NOMEM;
    attend_layout(&c, seq, pos, R, window, H, G, D, nthreads, &s);
    attend_rows(&A, R, out, &s);
    return TS_OK;
}

/* ---- a whole layer (layer.py) ---------------------------------------------------------------- */

typedef struct {
    const float *norms;     /* [n_norms, dim]: attention and MLP norms, then the post norms if any */
    i64 n_norms;
    const float *bqkv;      /* [(H+2G)*D] or NULL */
    const float *qk_norm;   /* [2, D] or NULL */
    float eps;
    int gelu;
    i64 H, G, D, dim, ffn;
    /* NOTE(layer-parts): the parts of wqkv, wo, w_gate_up and w_down in that order, parts[k] of
     * product k, each part's outputs the columns after the part before it (a Q4_K_M layer keeps its
     * q|k in Q4_K and its v in Q6_K: two parts of one product, each in the file's own blocks) */
    ts_weight w[LAYER_PARTS];
    i64 parts[4];
} ts_layer_weights;

/* out = x / sqrt(mean(x^2) + eps) * w over n values (out may be x): squares summed in 16 lanes */
static void norm(const float *x, const float *w, float eps, i64 n, float *out) {
    float l[LANES];
    for (int k = 0; k < LANES; k++) l[k] = 0.0f;
    i64 j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int k = 0; k < LANES; k++) l[k] += x[j + k] * x[j + k];
    for (; j < n; j++) l[j % LANES] += x[j] * x[j];
    const float rms = sqrtf(lanes_total(l) * (1.0f / (float)n) + eps);
    for (j = 0; j < n; j++) out[j] = x[j] / rms * w[j];
}

/* ts_layer's buffers: h [R, dim], qkv [R, W], att [R, H*D], gu [R, 2F], a [R, F], then the products'
 * and attention's, which never run at once, over the same bytes */
typedef struct {
    float *h, *qkv, *att, *gu, *a;
    product_bufs p;
    attend_bufs at;
} layer_bufs;

static void layer_layout(cut *c, const ts_layer_weights *L, i64 R, const i64 *seq, const i64 *pos, i64 window,
                         int nthreads, layer_bufs *s) {
    const i64 H = L->H, G = L->G, D = L->D, dim = L->dim, F = L->ffn;
    s->h = (float *)take(c, R * dim, sizeof(float));
    s->qkv = (float *)take(c, R * (H + 2 * G) * D, sizeof(float));
    s->att = (float *)take(c, R * H * D, sizeof(float));
    s->gu = (float *)take(c, R * 2 * F, sizeof(float));
    s->a = (float *)take(c, R * F, sizeof(float));
    i64 K = 0, lanes = 0;
    for (i64 k = 0; k < L->parts[0] + L->parts[1] + L->parts[2] + L->parts[3]; k++) {
        K = L->w[k].K > K ? L->w[k].K : K;
        if (L->w[k].half == 2 && L->w[k].R > lanes) lanes = L->w[k].R;     /* K-quant weights' tiles */
    }
    cut p = *c, at = *c;
    product_layout(&p, R, K, lanes, nthreads, &s->p);
    attend_layout(&at, seq, pos, R, window, H, G, D, nthreads, &s->at);
    c->used = p.used > at.used ? p.used : at.used;
    c->bad |= p.bad | at.bad;
}

int ts_layer(const ts_layer_weights *L, float *x, i64 R, const i64 *seq, const i64 *pos, const i64 *kv, int kind,
             i64 li, i64 window, const float *cos, const float *sin, i64 rot, int nthreads) {
    const i64 H = L->H, G = L->G, D = L->D, dim = L->dim, F = L->ffn, W = (H + 2 * G) * D;
    layer_bufs s;
    cut lay = {NULL, 0, 0};
    layer_layout(&lay, L, R, seq, pos, window, nthreads, &s);
    if (scratch_begin(&lay) != TS_OK) return TS_NOMEM;
    layer_layout(&lay, L, R, seq, pos, window, nthreads, &s);
    float *h = s.h, *qkv = s.qkv, *att = s.att, *gu = s.gu, *a = s.a;
    const ts_weight *wqkv = L->w, *wo = wqkv + L->parts[0], *wgu = wo + L->parts[1], *wd = wgu + L->parts[2];
    for (i64 r = 0; r < R; r++) norm(x + r * dim, L->norms, L->eps, dim, h + r * dim);
    parts_i8(h, R, wqkv, L->parts[0], qkv, nthreads, &s.p);
    kvset c = {kv, kind, li, G, D};
    for (i64 r = 0; r < R; r++) {
        float *qr = qkv + r * W;
        if (L->bqkv)
            for (i64 j = 0; j < W; j++) qr[j] += L->bqkv[j];
        const i64 p = pos[r];
        for (i64 hh = 0; hh < H + G; hh++) {
            float *v = qr + hh * D;
            if (L->qk_norm) norm(v, L->qk_norm + (hh < H ? 0 : D), L->eps, D, v);
            const float *cs = cos + p * rot, *sn = sin + p * rot;
            for (i64 i = 0; i < rot; i++) {
                const float x1 = v[i], x2 = v[rot + i];
                v[i] = x1 * cs[i] - x2 * sn[i];
                v[rot + i] = x2 * cs[i] + x1 * sn[i];
            }
        }
        for (i64 g = 0; g < G; g++) {
            void *kd = (void *)kv_row(&c, seq[r], 0, p, g), *vd = (void *)kv_row(&c, seq[r], 1, p, g);
            const float *ks = qr + (H + g) * D, *vs = qr + (H + G + g) * D;
            if (kind == KV_Q8) {
                ts_quantize_kv(ks, D, (int8_t *)kd);
                ts_quantize_kv(vs, D, (int8_t *)vd);
                continue;
            }
            for (i64 d = 0; d < D; d++) {
                if (kind == KV_F16) {
                    ((uint16_t *)kd)[d] = f2h(ks[d]);
                    ((uint16_t *)vd)[d] = f2h(vs[d]);
                } else {
                    ((float *)kd)[d] = ks[d];
                    ((float *)vd)[d] = vs[d];
                }
            }
        }
    }
    attn A = {qkv, W, seq, pos, window, H, c};
    attend_rows(&A, R, att, &s.at);
    parts_i8(att, R, wo, L->parts[1], h, nthreads, &s.p);
    for (i64 r = 0; r < R; r++) {
        float *xr = x + r * dim, *hr = h + r * dim;
        if (L->n_norms > 2) norm(hr, L->norms + 2 * dim, L->eps, dim, hr);
        for (i64 j = 0; j < dim; j++) xr[j] += hr[j];
        norm(xr, L->norms + dim, L->eps, dim, hr);
    }
    parts_i8(h, R, wgu, L->parts[2], gu, nthreads, &s.p);
    const float cg = (float)(2.0 * sqrt(2.0 / 3.14159265358979323846));
    for (i64 r = 0; r < R; r++) gate_row(gu + r * 2 * F, gu + r * 2 * F + F, a + r * F, F, L->gelu, cg);
    parts_i8(a, R, wd, L->parts[3], h, nthreads, &s.p);
    for (i64 r = 0; r < R; r++) {
        float *xr = x + r * dim, *hr = h + r * dim;
        if (L->n_norms > 3) norm(hr, L->norms + 3 * dim, L->eps, dim, hr);
        for (i64 j = 0; j < dim; j++) xr[j] += hr[j];
    }
    return TS_OK;
}
