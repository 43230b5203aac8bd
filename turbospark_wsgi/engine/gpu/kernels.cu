// Quantized matrix products and attention for the device engine (see __init__.py).
//
// One source, two builds. NVRTC compiles it for CuPy's RawModule on a GPU (__CUDACC__ defined).
// A host C++ compiler builds it for the tests: there a thread block's threads run one after the
// other inside each PHASE, and the block's "shared" arrays are locals of the block function. The
// kernels keep to what that models exactly: threads talk only through shared arrays, and only
// across PHASE boundaries (a __syncthreads on the device). No warp shuffles, no early returns.
//
// Weights stay in their GGUF blocks: a matrix is n rows of row_bytes bytes, each row its blocks in
// order, exactly as the file stores them. Every type is read 32 weights at a time (a UNIT): a
// Q4_0/Q4_1/Q8_0 block, a Q4_K sub-block, or two Q6_K sub-blocks of 16.
#ifdef __CUDACC__
#define SHARED __shared__
#define PHASE(nt) for (int tid = threadIdx.x, once_ = 1; once_; once_ = 0, __syncthreads())
#else
#include <math.h>
#include <string.h>
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define SHARED
#define PHASE(nt) for (int tid = 0; tid < (nt); ++tid)
#endif

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned long long u64;

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };   // ggml type ids
#define UNIT 32

#ifndef MM_THREADS
#define MM_THREADS 256
#endif
#ifndef MM_LANES
#define MM_LANES 32                          // threads per output row
#endif
#define MM_ROWS (MM_THREADS / MM_LANES)      // output rows per thread block
#ifndef MM_BATCH
#define MM_BATCH 4                           // input rows per thread block
#endif
#ifndef DQ_THREADS
#define DQ_THREADS 256
#endif
#ifndef AT_THREADS
#define AT_THREADS 128
#endif
#ifndef ST_THREADS
#define ST_THREADS 128
#endif
#ifndef AT_DMAX
#define AT_DMAX 256                          // largest head size
#endif
#ifndef NM_THREADS
#define NM_THREADS 256                       // threads of a row's RMSNorm
#endif
#ifndef EW_THREADS
#define EW_THREADS 256                       // threads of an elementwise block
#endif

__host__ __device__ __forceinline__ float bits_float(unsigned u) {
#ifdef __CUDACC__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

// Wide loads. Blocks are read 2 or 4 bytes at a time where the layout guarantees that alignment
// for every block of every row (rows are whole multiples of their block size, which is even, and
// a multiple of 4 for Q4_1 and Q4_K); x four floats at a time (rows of 32k floats, 16-aligned base).
#ifdef __CUDACC__
#define UNROLL _Pragma("unroll")
__device__ __forceinline__ unsigned ld16(const u8* p) { return *(const unsigned short*)p; }
__device__ __forceinline__ unsigned ld32(const u8* p) { return *(const unsigned*)p; }
__device__ __forceinline__ void ld_f4(const float* p, float* v) {
  float4 t = *(const float4*)p;
  v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
}
#else
#define UNROLL
inline unsigned ld16(const u8* p) { unsigned short v; memcpy(&v, p, 2); return v; }
inline unsigned ld32(const u8* p) { unsigned v; memcpy(&v, p, 4); return v; }
inline void ld_f4(const float* p, float* v) { memcpy(v, p, 16); }
#endif

// 4n bytes at p (2-aligned) as n little-endian words; BYTE(q, i) is byte i of them
__host__ __device__ __forceinline__ void ld_words2(const u8* p, unsigned* q, int n) {
  UNROLL for (int i = 0; i < n; ++i) q[i] = ld16(p + 4 * i) | (ld16(p + 4 * i + 2) << 16);
}
__host__ __device__ __forceinline__ void ld_words4(const u8* p, unsigned* q, int n) {
  UNROLL for (int i = 0; i < n; ++i) q[i] = ld32(p + 4 * i);
}
#define BYTE(q, i) (((q)[(i) >> 2] >> (((i) & 3) * 8)) & 255u)

// the little-endian IEEE half at p (2-aligned)
__host__ __device__ __forceinline__ float f16(const u8* p) {
  unsigned h = ld16(p);
  unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
  if (e == 0) {
    float v = (float)m * 5.9604644775390625e-08f;    // subnormal: m * 2^-24
    return sign ? -v : v;
  }
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
  return bits_float(sign | ((e + 112) << 23) | (m << 13));
}

// weights u*32 .. u*32+31 of a row of type t, as float32
__host__ __device__ void decode32(int t, const u8* row, int u, float* w) {
  unsigned q[8], hq[8];
  if (t == Q4_0) {                           // 18 bytes: half d, 16 bytes (low nibbles 0-15, high 16-31)
    const u8* b = row + u * 18;
    float d = f16(b);
    ld_words2(b + 2, q, 4);
    UNROLL for (int i = 0; i < 16; ++i) {
      w[i] = (float)((int)(BYTE(q, i) & 15) - 8) * d;
      w[i + 16] = (float)((int)(BYTE(q, i) >> 4) - 8) * d;
    }
  } else if (t == Q4_1) {                    // 20 bytes: half d, half m, 16 bytes as Q4_0
    const u8* b = row + u * 20;
    float d = f16(b), m = f16(b + 2);
    ld_words4(b + 4, q, 4);
    UNROLL for (int i = 0; i < 16; ++i) {
      w[i] = (float)(BYTE(q, i) & 15) * d + m;
      w[i + 16] = (float)(BYTE(q, i) >> 4) * d + m;
    }
  } else if (t == Q8_0) {                    // 34 bytes: half d, 32 int8
    const u8* b = row + u * 34;
    float d = f16(b);
    ld_words2(b + 2, q, 8);
    UNROLL for (int i = 0; i < 32; ++i) w[i] = (float)(i8)BYTE(q, i) * d;
  } else if (t == Q4_K) {                    // 144 bytes per 256: half d, half dmin, 12 bytes of 6-bit scales/mins, 128 bytes
    const u8* b = row + (u >> 3) * 144;
    const u8* s = b + 4;
    int j = u & 7, sc, mn;
    if (j < 4) {
      sc = s[j] & 63;
      mn = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    float d = f16(b) * (float)sc, m = f16(b + 2) * (float)mn;
    ld_words4(b + 16 + (j >> 1) * 32, q, 8); // sub-blocks 2c and 2c+1: low and high nibbles of 32 bytes
    int shift = (j & 1) * 4;
    UNROLL for (int i = 0; i < 32; ++i) w[i] = d * (float)((BYTE(q, i) >> shift) & 15) - m;
  } else {                                   // Q6_K, 210 bytes per 256: ql[128], qh[64], int8 scales[16], half d
    const u8* b = row + (u >> 3) * 210;
    int j = u & 7, h = j >> 2, qq = j & 3;   // half of the super-block, quarter of that half
    ld_words2(b + h * 64 + (qq & 1) * 32, q, 8);   // ql
    ld_words2(b + 128 + h * 32, hq, 8);            // qh
    const i8* sc = (const i8*)(b + 192 + h * 8 + qq * 2);
    int ls = (qq >> 1) * 4, hs = qq * 2;
    float d = f16(b + 208), d0 = d * (float)sc[0], d1 = d * (float)sc[1];
    UNROLL for (int i = 0; i < 32; ++i) {
      int v = (int)(((BYTE(q, i) >> ls) & 15) | (((BYTE(hq, i) >> hs) & 3) << 4)) - 32;
      w[i] = (i < 16 ? d0 : d1) * (float)v;
    }
  }
}

// y[b, col0 + r] = scale * sum_c x[b, c] W[r, c] for rows r of block bx and inputs b of block by.
// MM_LANES threads share a row, each taking every MM_LANES-th unit; the row's first thread sums.
// The grid is (input blocks, row blocks): the blocks reading the same rows run side by side.
__host__ __device__ void qmatmul_block(int bx, int by, int t, const u8* W, int n, int k, long row_bytes,
                                       const float* x, int ldx, int B, float* y, int ldy, int col0, float scale) {
  SHARED float part[MM_BATCH][MM_THREADS];
  PHASE(MM_THREADS) {
    int r = bx * MM_ROWS + tid / MM_LANES, lane = tid % MM_LANES;
    float acc[MM_BATCH], w[UNIT];
    for (int b = 0; b < MM_BATCH; ++b) acc[b] = 0.0f;
    if (r < n) {
      for (int u = lane; u < k / UNIT; u += MM_LANES) {
        decode32(t, W + r * row_bytes, u, w);
        for (int b = 0; b < MM_BATCH; ++b) {
          int row = by * MM_BATCH + b;
          if (row < B) {
            const float* xr = x + (long)row * ldx + u * UNIT;
            float s = 0.0f, xv[4];
            UNROLL for (int i = 0; i < UNIT; i += 4) {
              ld_f4(xr + i, xv);
              s += w[i] * xv[0] + w[i + 1] * xv[1] + w[i + 2] * xv[2] + w[i + 3] * xv[3];
            }
            acc[b] += s;
          }
        }
      }
    }
    for (int b = 0; b < MM_BATCH; ++b) part[b][tid] = acc[b];
  }
  PHASE(MM_THREADS) {
    int r = bx * MM_ROWS + tid / MM_LANES;
    if (tid % MM_LANES == 0 && r < n) {
      for (int b = 0; b < MM_BATCH; ++b) {
        int row = by * MM_BATCH + b;
        if (row < B) {
          float s = 0.0f;
          for (int l = 0; l < MM_LANES; ++l) s += part[b][tid + l];
          y[(long)row * ldy + col0 + r] = s * scale;
        }
      }
    }
  }
}

// y[i, :k] = scale * row rows[i] (or i, when rows is null) of W, for i < n; one thread per unit
__host__ __device__ void dequant_block(int bx, int t, const u8* W, int n, int k, long row_bytes, const int* rows,
                                       float* y, int ldy, float scale) {
  PHASE(DQ_THREADS) {
    long i = (long)bx * DQ_THREADS + tid;
    int units = k / UNIT;
    long r = i / units;
    int u = (int)(i % units);
    if (r < n) {
      float w[UNIT];
      decode32(t, W + (rows ? (long)rows[r] : r) * row_bytes, u, w);
      for (int j = 0; j < UNIT; ++j) y[r * ldy + u * UNIT + j] = w[j] * scale;
    }
  }
}

// out[r, h*D + d]: softmax(q . k_j) weighted sum of v_j over the keys j of query row r, head h:
// positions lo..pos[r] (lo = pos[r] - window + 1 with a window, else 0). Row r's keys and values
// are float32 [*, G, D] at kv[r] and kv[R + r] plus layer * lstride[r] floats (a sequence's cache
// holds every layer, lstride[r] floats apart); query head h reads KV head h / (H / G).
// Keys go in tiles of AT_THREADS, one per thread, with a running max and sum (online softmax);
// a tile's max and sum are tree reductions over the block.
__host__ __device__ void attend_block(int h, int r, const float* q, const u64* kv, const long* lstride, int layer,
                                      const int* pos, int R, int H, int G, int D, int window, float* out) {
  SHARED float qs[AT_DMAX], acc[AT_DMAX], s[AT_THREADS], red[AT_THREADS], st[3];   // st: max, sum, rescale
  const int p = pos[r], lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0, g = h / (H / G);
  const float* K = (const float*)kv[r] + layer * lstride[r];
  const float* V = (const float*)kv[R + r] + layer * lstride[r];
  PHASE(AT_THREADS) {
    for (int d = tid; d < D; d += AT_THREADS) {
      qs[d] = q[((long)r * H + h) * D + d];
      acc[d] = 0.0f;
    }
    if (tid == 0) {
      st[0] = bits_float(0xff800000u);       // -inf
      st[1] = 0.0f;
    }
  }
  for (int start = lo; start <= p; start += AT_THREADS) {
    const int n = p - start + 1 < AT_THREADS ? p - start + 1 : AT_THREADS;   // keys in this tile
    PHASE(AT_THREADS) {
      float v = bits_float(0xff800000u);
      if (tid < n) {
        const float* kj = K + ((long)(start + tid) * G + g) * D;
        v = 0.0f;
        for (int d = 0; d < D; ++d) v += qs[d] * kj[d];
      }
      s[tid] = v;
      red[tid] = v;
    }
    for (int w = AT_THREADS / 2; w > 0; w >>= 1) {
      PHASE(AT_THREADS) { if (tid < w) red[tid] = fmaxf(red[tid], red[tid + w]); }
    }
    PHASE(AT_THREADS) {
      if (tid == 0) {
        float m = fmaxf(st[0], red[0]);
        st[2] = expf(st[0] - m);             // what the sums so far are rescaled by
        st[0] = m;
      }
    }
    PHASE(AT_THREADS) {
      s[tid] = expf(s[tid] - st[0]);         // -inf past the tile's keys: 0
      red[tid] = s[tid];
    }
    for (int w = AT_THREADS / 2; w > 0; w >>= 1) {
      PHASE(AT_THREADS) { if (tid < w) red[tid] += red[tid + w]; }
    }
    PHASE(AT_THREADS) {
      for (int d = tid; d < D; d += AT_THREADS) {
        float a = acc[d] * st[2];
        for (int i = 0; i < n; ++i) a += s[i] * V[((long)(start + i) * G + g) * D + d];
        acc[d] = a;
      }
      if (tid == 0) st[1] = st[1] * st[2] + red[0];
    }
  }
  PHASE(AT_THREADS) {
    for (int d = tid; d < D; d += AT_THREADS) out[((long)r * H + h) * D + d] = acc[d] / st[1];
  }
}

// stores row r of k and v (float32 [R, G*D]) at position pos[r] of layer `layer` of row r's cache
// (addressed as in attend_block)
__host__ __device__ void store_block(int r, const float* k, const float* v, const u64* kv, const long* lstride,
                                     int layer, const int* pos, int R, int GD) {
  float* K = (float*)kv[r] + layer * lstride[r] + (long)pos[r] * GD;
  float* V = (float*)kv[R + r] + layer * lstride[r] + (long)pos[r] * GD;
  PHASE(ST_THREADS) {
    for (int e = tid; e < GD; e += ST_THREADS) {
      K[e] = k[(long)r * GD + e];
      V[e] = v[(long)r * GD + e];
    }
  }
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w over D values (rows ldx and ldo floats apart): a
// decode step's norm in one launch where the array code took seven
__host__ __device__ void rmsnorm_block(int r, const float* x, int ldx, const float* w, float eps, int D, float* out,
                                       int ldo) {
  SHARED float red[NM_THREADS];
  const float* xr = x + (long)r * ldx;
  float* o = out + (long)r * ldo;
  PHASE(NM_THREADS) {
    float a = 0.0f;
    for (int d = tid; d < D; d += NM_THREADS) a += xr[d] * xr[d];
    red[tid] = a;
  }
  for (int v = NM_THREADS / 2; v > 0; v >>= 1) {
    PHASE(NM_THREADS) { if (tid < v) red[tid] += red[tid + v]; }
  }
  PHASE(NM_THREADS) {
    const float rms = sqrtf(red[0] / (float)D + eps);
    for (int d = tid; d < D; d += NM_THREADS) o[d] = xr[d] / rms * w[d];
  }
}

// out[r, j] = act(gate) * up for gu[r] = gate (F values) | up (F values): SiLU as t (1 + tanh t),
// t = gate / 2 (no exp overflow), or GELU's tanh form (gelu != 0); one thread per output value
__host__ __device__ void gate_block(int b, const float* gu, int F, int gelu, float* out, long n) {
  PHASE(EW_THREADS) {
    const long e = (long)b * EW_THREADS + tid;
    if (e < n) {
      const long r = e / F, j = e % F;
      const float g = gu[r * 2 * F + j], u = gu[r * 2 * F + F + j];
      float a;
      if (gelu) {
        a = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
      } else {
        const float t = 0.5f * g;
        a = t * (1.0f + tanhf(t));
      }
      out[e] = a * u;
    }
  }
}

// rotary embedding of x [R, heads, D] (rows ldx floats apart, heads contiguous) into out [R, heads, D]:
// pairs (i, i + half) of each head's first 2*half dims by cos/sin [R, half], the rest copied; one
// thread per output value (model.rope's numbers)
__host__ __device__ void rope_block(int b, const float* x, int ldx, const float* cs, const float* sn, int half,
                                    int heads, int D, float* out, long n) {
  PHASE(EW_THREADS) {
    const long e = (long)b * EW_THREADS + tid;
    if (e < n) {
      const long r = e / ((long)heads * D);
      const int d = (int)(e % D);
      const float* xh = x + r * ldx + (e / D % heads) * D;
      float v = xh[d];
      if (d < 2 * half) {
        const int i = d < half ? d : d - half;
        const float c = cs[r * half + i], s = sn[r * half + i];
        v = d < half ? xh[i] * c - xh[i + half] * s : xh[i + half] * c + xh[i] * s;
      }
      out[e] = v;
    }
  }
}

#ifdef __CUDACC__
extern "C" __global__ void rope(const float* x, int ldx, const float* cs, const float* sn, int half, int heads, int D,
                                float* out, long n) {
  rope_block(blockIdx.x, x, ldx, cs, sn, half, heads, D, out, n);
}

extern "C" __global__ void rmsnorm(const float* x, int ldx, const float* w, float eps, int D, float* out, int ldo) {
  rmsnorm_block(blockIdx.x, x, ldx, w, eps, D, out, ldo);
}

extern "C" __global__ void gate(const float* gu, int F, int gelu, float* out, long n) {
  gate_block(blockIdx.x, gu, F, gelu, out, n);
}

extern "C" __global__ void qmatmul(int t, const u8* W, int n, int k, long row_bytes, const float* x, int ldx, int B,
                                   float* y, int ldy, int col0, float scale) {
  qmatmul_block(blockIdx.y, blockIdx.x, t, W, n, k, row_bytes, x, ldx, B, y, ldy, col0, scale);
}

extern "C" __global__ void dequant(int t, const u8* W, int n, int k, long row_bytes, const int* rows, float* y,
                                   int ldy, float scale) {
  dequant_block(blockIdx.x, t, W, n, k, row_bytes, rows, y, ldy, scale);
}

extern "C" __global__ void attend(const float* q, const u64* kv, const long* lstride, int layer, const int* pos,
                                  int R, int H, int G, int D, int window, float* out) {
  attend_block(blockIdx.x, blockIdx.y, q, kv, lstride, layer, pos, R, H, G, D, window, out);
}

extern "C" __global__ void store(const float* k, const float* v, const u64* kv, const long* lstride, int layer,
                                 const int* pos, int R, int GD) {
  store_block(blockIdx.x, k, v, kv, lstride, layer, pos, R, GD);
}
#else
// the same launches on the host: every thread block of the grid in turn
extern "C" void rope(int gx, int gy, const float* x, int ldx, const float* cs, const float* sn, int half, int heads,
                     int D, float* out, long n) {
  for (int bx = 0; bx < gx; ++bx) rope_block(bx, x, ldx, cs, sn, half, heads, D, out, n);
}

extern "C" void rmsnorm(int gx, int gy, const float* x, int ldx, const float* w, float eps, int D, float* out, int ldo) {
  for (int bx = 0; bx < gx; ++bx) rmsnorm_block(bx, x, ldx, w, eps, D, out, ldo);
}

extern "C" void gate(int gx, int gy, const float* gu, int F, int gelu, float* out, long n) {
  for (int bx = 0; bx < gx; ++bx) gate_block(bx, gu, F, gelu, out, n);
}

extern "C" void qmatmul(int gx, int gy, int t, const u8* W, int n, int k, long row_bytes, const float* x, int ldx,
                        int B, float* y, int ldy, int col0, float scale) {
  for (int by = 0; by < gy; ++by)
    for (int bx = 0; bx < gx; ++bx) qmatmul_block(by, bx, t, W, n, k, row_bytes, x, ldx, B, y, ldy, col0, scale);
}

extern "C" void dequant(int gx, int gy, int t, const u8* W, int n, int k, long row_bytes, const int* rows, float* y,
                        int ldy, float scale) {
  for (int bx = 0; bx < gx; ++bx) dequant_block(bx, t, W, n, k, row_bytes, rows, y, ldy, scale);
}

extern "C" void attend(int gx, int gy, const float* q, const u64* kv, const long* lstride, int layer, const int* pos,
                       int R, int H, int G, int D, int window, float* out) {
  for (int by = 0; by < gy; ++by)
    for (int bx = 0; bx < gx; ++bx) attend_block(bx, by, q, kv, lstride, layer, pos, R, H, G, D, window, out);
}

extern "C" void store(int gx, int gy, const float* k, const float* v, const u64* kv, const long* lstride, int layer,
                      const int* pos, int R, int GD) {
  for (int bx = 0; bx < gx; ++bx) store_block(bx, k, v, kv, lstride, layer, pos, R, GD);
}
#endif
