"""Quantized weights kept in block form: GGUF blocks decoded into a few kernel layouts, row-tiled
for the CPU kernels, plus a pure-numpy dequantizing reference.

Two layouts cover every supported GGUF type (value = q * d + m per block):

* "q4": 32 weights per block as 16 bytes, low nibbles = weights 0-15, high nibbles = 16-31
  (Q4_0: m = -8d; Q4_1: d, m as stored; Q4_K: d = d*scale, m = -dmin*min per 32-weight sub-block).
* "q8": int8 weights in sub-blocks of 16 with no min; one scale per `group` sub-blocks
  (Q8_0: group 2; Q5_0: group 2, its 5-bit q - 16; Q6_K: group 1, q - 32 and d = d*scale).

`Blocks` is the row-major decoded form, on which rows can be permuted, scaled and concatenated.
`QWeight` is the tiled form the kernels read: `tile` consecutive output rows are interleaved so
that one SIMD lane holds one row (byte j of a block for rows r..r+tile is contiguous).

NOTE(scales-f16): a QWeight keeps its scales (and mins) as float16 where every one of them is a
float16 exactly (GGUF stores Q4_0/Q4_1/Q5_0/Q8_0's as float16; a power-of-two row scaling keeps
them so unless one leaves the half range), else as float32; a q4 weight whose mins are all -8d
(Q4_0) keeps none (m None). The kernels convert, so the values, and every product's bits, are those
of the float32 form. Q4_0 then reads 16 + 2 bytes per 32 weights, as the file's blocks; Q8_0 32 + 2.

NOTE(k-scales): the K-quants keep their scales in two levels as the file does: Q4_K's 6-bit scale
and min per 32 weights as uint8 (QWeight.d, .m) under a float32 d and -dmin per 256 (.ds, .ms);
Q6_K's int8 scale per 16 under a float32 d per 256. Every value d = sc * ds is one float32 rounding
of the same product the float form held, so the bits stay those of the float32 form; a row scaling
(the folded query scale) scales ds and ms. Q4_K reads 16 + 1 + 1 + 8/8 = 19 bytes per 32 weights
(file: 18; float32 scales and mins: 24), Q6_K 32 + 2 + 0.5 per 32 (file: 26.25 at 6 bits; float32
scales: 40). A fused matrix whose parts are different K-quants, or a K-quant beside another type,
keeps float32 scales.

PERF(scales-f16): decode reads every weight once a token, so its rate follows these bytes. The 1.1B
Q4_0 llama of tools/make_bench_model.py (Q8_0 tied head): 843 -> 654 MB a token, the worker's blocks
1,430 -> 1,242 MB; tools/bench.py in process, 2 Zen 5 cores, alternating runs of the float32 form and
this one, medians: decode 52.1 -> 64.6 tok/s (vnni512), 34.1 -> 50.0 (avx2); 128-token prefill
~185 -> ~197. SmolLM2-135M Q4_1 (112 -> 96 MB a token): 190 -> 203 tok/s (vnni512), 189 -> 200 (avx2).
"""
from dataclasses import dataclass

import numpy as np

SUPPORTED = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}   # ggml type id -> name
DEFAULT_TILE = None   # pick per matrix: see tile_for
QK = 32          # weights per q4 block
SUB = 16         # weights per q8 sub-block (and bytes per q4 block)


@dataclass(slots=True)
class KScales:
    """A K-quant's two-level scales (NOTE(k-scales)): d = sc * ds and m = mn * ms, the sub-block
    integers sc, mn [n, units] as the file holds them and one float32 super scale per `group` units
    (ds, ms [n, units/group]; ms = -dmin, so m = -(dmin * mn) exactly as the float form)."""

    sc: np.ndarray   # Q4_K: uint8 (6-bit scales); Q6_K: int8
    ds: np.ndarray
    mn: object       # Q4_K: uint8 (6-bit mins); Q6_K: None
    ms: object

    @property
    def group(self):
        return self.sc.shape[1] // self.ds.shape[1]

    def values(self):
        """(d, m) in float32 [n, units]: each a single rounding of the integer times its super scale."""
        return _times(self.sc, self.ds), None if self.mn is None else _times(self.mn, self.ms)

    def map(self, fn):
        return KScales(fn(self.sc), fn(self.ds), None if self.mn is None else fn(self.mn),
                       None if self.ms is None else fn(self.ms))


@dataclass(slots=True)
class Blocks:
    """Row-major decoded blocks of an [n, k] weight (rows = output features)."""

    kind: str        # "q4" | "q8"
    q: np.ndarray    # q4: uint8 [n, k/32, 16]; q8: int8 [n, k/16, 16]
    d: np.ndarray    # float32 [n, k/32] (q4) or [n, k/(16*group)] (q8)
    m: object        # float32 [n, k/32] (q4) or None (q8)
    ks: object = None   # KScales d and m are made of (Q4_K, Q6_K), or None

    @classmethod
    def factored(cls, kind, q, ks):
        """Blocks whose scales are K-quant KScales `ks` (d and m computed from them)."""
        d, m = ks.values()
        return cls(kind, q, d, m, ks)

    @property
    def shape(self):
        per = QK if self.kind == "q4" else SUB
        return self.q.shape[0], self.q.shape[1] * per

    def map_rows(self, fn):
        """A copy with `fn` applied to every array along its row axis (e.g. a row permutation)."""
        return Blocks(self.kind, fn(self.q), fn(self.d), None if self.m is None else fn(self.m),
                      None if self.ks is None else self.ks.map(fn))

    def scaled(self, s):
        """A copy whose values are multiplied by `s` (exact when s is a power of two; K-quant
        scales scale their super scales, d and m recomputed from them)."""
        s = np.float32(s)
        if self.ks is not None:
            ks = self.ks
            return Blocks.factored(self.kind, self.q, KScales(ks.sc, ks.ds * s, ks.mn,
                                                              None if ks.ms is None else ks.ms * s))
        return Blocks(self.kind, self.q, self.d * s, None if self.m is None else self.m * s)


@dataclass(slots=True)
class QWeight:
    """Tiled blocks of an [n, k] weight; `tile` output rows per SIMD-lane group (n padded up).

    NOTE(one-layout): the int8 kernels read `qv` (quant.prepare), the float kernels and
    the references `qs`; a weight holds one of the two once `drop_tiled` ran (what the int8 loader
    keeps: the packed weights file maps `qv` alone, engine/packed.py), and `qs` is rebuilt from `qv`
    (and kept) only when a float path asks for it."""

    kind: str
    n: int
    k: int
    tiled: object    # qs, or None where only qv is held (read it as `qs`)
    d: np.ndarray    # float16 or float32 [T, nd, tile] (NOTE(scales-f16))
    m: object        # q4 mins of d's type [T, k/32, tile], or None (q8; q4: m = -8d)
    qv: object = None   # the int8-activation kernels' layout, built on first use (quant.prepare)
    cw: object = None   # the kernels' views of it (kernels/native.py, float_scales), built on first use
    ds: object = None   # K-quants (NOTE(k-scales)): d, m hold the integer sub-scales and mins and
    ms: object = None   # these the float32 super scales [T, nu/group, tile] (value = d * ds, m * ms)

    @property
    def qs(self):
        """q4: uint8 [T, k/32, 16, tile]; q8: int8 [T, k/16, 16, tile] (rebuilt from qv where dropped)."""
        if self.tiled is None:
            self.tiled = unprepare(self)
        return self.tiled

    def drop_tiled(self):
        """Keeps only the int8 layout (qv must be built): the float paths rebuild qs on demand."""
        if self.qv is None:
            raise ValueError("drop_tiled needs the int8 layout (quant.prepare) first")
        self.tiled = None

    @property
    def tile(self):
        return self.d.shape[-1]

    @property
    def tiles(self):
        """T, the number of row tiles (n padded up to a whole tile)."""
        return self.d.shape[0]

    @property
    def group(self):
        """Units per super scale (K-quants), or 0."""
        return 0 if self.ds is None else self.d.shape[1] // self.ds.shape[1]

    @property
    def scales(self):
        """d as float32 (a new array where d is float16 or K-quant sub-scales)."""
        return _times(self.d, self.ds)

    @property
    def mins(self):
        """The q4 mins as float32 (-8d where none are kept), or None for q8."""
        if self.kind != "q4":
            return None
        return self.scales * np.float32(-8) if self.m is None else _times(self.m, self.ms)

    def lane_scales(self, t, r):
        """(d, m) of the rows (tile t [N], lane r [N]) in float32 [N, units] (m None for q8)."""
        d = _times(self.d[t, ..., r], None if self.ds is None else self.ds[t, ..., r])
        if self.kind == "q8":
            return d, None
        if self.m is None:
            return d, d * np.float32(-8)
        return d, _times(self.m[t, ..., r], None if self.ms is None else self.ms[t, ..., r])

    @property
    def nbytes(self):
        extra = [a.nbytes for a in (self.tiled, self.m, self.qv, self.ds, self.ms) if a is not None]
        return self.d.nbytes + sum(extra)


def _times(q, s):
    """q as float32, times its super scales s (repeated along the unit axis, 1) where given."""
    if s is None:
        return q.astype(np.float32, copy=False)
    return q.astype(np.float32) * np.repeat(s, q.shape[1] // s.shape[1], axis=1)


@dataclass(slots=True)
class QMatrix:
    """A weight y = x @ W.T made of row-stacked parts (one part unless the fused types differ)."""

    parts: list      # [QWeight], output rows in order
    n: int
    k: int

    @property
    def shape(self):
        return self.n, self.k

    @property
    def nbytes(self):
        return sum(p.nbytes for p in self.parts)


# ---------------------------------------------------------------------------- GGUF blocks

def supported(ggml_type, shape):
    """Whether a GGUF tensor of this type and shape can be held in block form (else keep float32)."""
    per = 256 if SUPPORTED.get(ggml_type, "").endswith("_K") else QK
    return ggml_type in SUPPORTED and len(shape) == 2 and shape[1] % per == 0


def decode(raw, ggml_type, shape):
    """GGUF tensor bytes (uint8 [n, row_bytes], e.g. `GGUFFile.raw(name)`) of a 2-D weight of
    `shape` (n, k) -> Blocks. Unsupported types raise ValueError naming them."""
    if ggml_type not in SUPPORTED:
        raise ValueError(f"no block kernel for GGUF type #{ggml_type}")
    name = SUPPORTED[ggml_type]
    n, k = shape
    per = 256 if name.endswith("_K") else QK
    if k % per:
        raise ValueError(f"{name} row length {k} is not a multiple of {per}")
    raw = np.asarray(raw, dtype=np.uint8).reshape(n, k // per, -1)       # [n, blocks, bytes]
    return _DECODERS[name](raw)


def _f16(raw, at):
    """The float16 at byte `at` of every block, as float32 [n, blocks]."""
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _q8_0(raw):
    q = np.ascontiguousarray(raw[..., 2:34]).view(np.int8)              # [n, nb, 32]
    return Blocks("q8", q.reshape(q.shape[0], -1, SUB), _f16(raw, 0), None)


def _q5_0(raw):
    # 32 weights: float16 d, 32 high bits (bit j of weight j), 16 bytes of low nibbles as in Q4_0
    n, nb, _ = raw.shape
    qh = np.ascontiguousarray(raw[..., 2:6]).view("<u4")                  # [n, nb, 1]
    hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)    # [n, nb, 32]
    qs = raw[..., 6:22]
    lo = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int16)     # [n, nb, 32]
    q = ((lo | (hi << 4)) - 16).astype(np.int8)
    return Blocks("q8", q.reshape(n, -1, SUB), _f16(raw, 0), None)


def _q4_0(raw):
    d = _f16(raw, 0)
    return Blocks("q4", np.ascontiguousarray(raw[..., 2:18]), d, d * np.float32(-8.0))


def _q4_1(raw):
    return Blocks("q4", np.ascontiguousarray(raw[..., 4:20]), _f16(raw, 0), _f16(raw, 2))


def _q4_k(raw):
    n, nsb, _ = raw.shape
    d, dmin, s = _f16(raw, 0), _f16(raw, 2), raw[..., 4:16].astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = raw[..., 16:144].reshape(n, nsb, 4, 1, 32)                    # 4 chunks of 64 weights
    v = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, nsb * 8, 32)   # sub-block values
    q = v[..., :16] | (v[..., 16:] << 4)                                # q4 nibble order
    ks = KScales(sc.reshape(n, -1), d, mn.reshape(n, -1), -dmin)      # m = -(dmin * mn)
    return Blocks.factored("q4", np.ascontiguousarray(q), ks)


def _q6_k(raw):
    n, nsb, _ = raw.shape
    ql, qh = raw[..., 0:128].reshape(n, nsb, 2, 2, 32), raw[..., 128:192].reshape(n, nsb, 2, 1, 32)
    sc = np.ascontiguousarray(raw[..., 192:208]).view(np.int8)         # [n, nsb, 16]
    lo = np.concatenate([ql & 15, ql >> 4], axis=3)                     # [n, nsb, 2, 4, 32]
    hi = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3          # [n, nsb, 2, 4, 32]
    q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)
    ks = KScales(sc.reshape(n, -1), _f16(raw, 208), None, None)        # one scale per 16
    return Blocks.factored("q8", q.reshape(n, -1, SUB), ks)


_DECODERS = {"Q8_0": _q8_0, "Q5_0": _q5_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}


# ---------------------------------------------------------------------------- tiling

def pack(parts, tile=DEFAULT_TILE):
    """Row-stacks `parts` (Blocks, all with the same k) into a QMatrix of tiled weights; neighbours
    of the same layout are fused into one QWeight."""
    parts = [parts] if isinstance(parts, Blocks) else list(parts)
    k = parts[0].shape[1]
    if any(p.shape[1] != k for p in parts):
        raise ValueError(f"cannot stack weights with different row lengths {[p.shape for p in parts]}")
    groups = []
    for p in parts:
        if groups and _fusable(groups[-1][-1], p):
            groups[-1].append(p)
        else:
            groups.append([p])
    tiled = [_tile(b, tile or tile_for(b.shape[0])) for b in map(_concat, groups)]
    return QMatrix(tiled, sum(t.n for t in tiled), k)


def tile_for(n):
    """Output rows per lane group: 128 when it divides n (measured ~10-25% faster than 64 for
    B = 1), else 64, else 32 with padding rows."""
    # PERF(tile): wider tiles give the vectorised row loop more independent accumulators.
    return next((t for t in (128, 64) if n % t == 0), 32)


def _fusable(a, b):
    return a.kind == b.kind and a.d.shape[1] == b.d.shape[1]


def _concat(group):
    if len(group) == 1:
        return group[0]
    cat = np.concatenate
    m = None if group[0].m is None else cat([g.m for g in group])
    # K-quant scales stay factored only where every part is the same K-quant (else float32 d, m)
    kinds = {None if g.ks is None else (g.ks.sc.dtype, g.ks.group, g.ks.mn is None) for g in group}
    ks = None
    if len(kinds) == 1 and None not in kinds:
        fields = zip(*[(g.ks.sc, g.ks.ds, g.ks.mn, g.ks.ms) for g in group])
        ks = KScales(*(None if f[0] is None else cat(f) for f in fields))
    return Blocks(group[0].kind, cat([g.q for g in group]), cat([g.d for g in group]), m, ks)


def _tile(b, tile):
    n, k = b.shape

    def lanes(a):                                                       # [n, ...] -> [T, ..., tile]
        pad = -n % tile
        if pad:
            a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
        a = a.reshape(-1, tile, *a.shape[1:])
        return np.ascontiguousarray(np.moveaxis(a, 1, -1))

    if b.ks is not None:                                                # NOTE(k-scales)
        ks = b.ks.map(lanes)
        return QWeight(b.kind, n, k, lanes(b.q), ks.sc, ks.mn, ds=ks.ds, ms=ks.ms)
    d, m = _compact(lanes(b.d), None if b.m is None else lanes(b.m))
    return QWeight(b.kind, n, k, lanes(b.q), d, m)


def _compact(d, m):
    """(d, m) as a QWeight keeps them (NOTE(scales-f16)): m dropped where it is -8d everywhere, both
    float16 where every value is one exactly."""
    if m is not None and np.array_equal(m, d * np.float32(-8)):
        m = None
    arrays = [a for a in (d, m) if a is not None]
    if all(_exact_half(a) for a in arrays):
        d, m = (None if a is None else a.astype(np.float16) for a in (d, m))
    return d, m


def _exact_half(a):
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    return bool(np.isfinite(h).all() and np.array_equal(h.astype(np.float32), a))


def float_scales(w):
    """(d, m) of QWeight w in float32 (m: the q4 mins, None for q8), built on first use and kept on
    w (`w.cw`) for the kernels that read float32 scales (the numba kernels, the float C kernels)."""
    held = w.cw.get("scales") if w.cw else None
    if held is None:
        m = w.mins
        held = (np.ascontiguousarray(w.scales), None if m is None else np.ascontiguousarray(m))
        w.cw = {**(w.cw or {}), "scales": held}
    return held


def untile(w):
    """QWeight -> row-major Blocks (the inverse of tiling, padding rows dropped; scales float32)."""
    def rows(a):
        return np.moveaxis(a, -1, 1).reshape(-1, *a.shape[1:-1])[:w.n]
    return Blocks(w.kind, rows(w.qs), rows(w.scales), None if w.kind == "q8" else rows(w.mins))


# ---------------------------------------------------------------------------- the int8 kernels' layout

LANES = 16      # output rows per 512-bit accumulator (kernels/int8.py)


def fits(p):
    """Whether the int8 kernels take part `p`: its tile fills whole accumulators."""
    return p.tile % LANES == 0


def prepare(p):
    """The int8 kernels' layout of a QWeight (kept on it as `p.qv`): uint8
    [T, units, R/16, quads, 16, 4] (see kernels/int8.py's docstring); a Q6_K weight in 6 bits,
    3 blocks a unit where 8 bits take 4 (NOTE(q6))."""
    if p.qv is None:
        T, n_sub, S, R = p.qs.shape                                    # S = 16 bytes per block/sub-block
        per = 1 if p.kind == "q4" else n_sub // p.d.shape[1]           # q8: sub-blocks per scale
        q = p.qs.view(np.uint8) if p.kind == "q4" else (p.qs.view(np.uint8) ^ np.uint8(128))
        # [T, units, per, S, R] -> [T, units, R/16, per*S/4 quads, 16, 4]
        q = q.reshape(T, n_sub // per, per * S // 4, 4, R // LANES, LANES)
        qv = np.ascontiguousarray(q.transpose(0, 1, 4, 2, 5, 3))
        p.qv = _narrow(qv) if _six_fits(p) else qv
    return p.qv


# NOTE(q6): Q6_K's weights are 6 bits (q in -32..31), its sub-blocks 16 wide. Kept as int8 they were
# 34.5 bytes per 32 weights against the file's 26.25: every decode step read a third more of a Q6_K
# matrix than the file holds (the head of a Q4_K_M file, its attn_v and half its ffn_down). In 6 bits
# a unit of 16 weights x 16 rows is 3 blocks of [16 rows, 4 bytes] where 8 bits take 4 quads: block 0
# holds the low 4 bits of quad 0 (low nibbles) and quad 2 (high nibbles), block 1 those of quads 1 and
# 3, block 2 the top 2 bits of quad g at bits 2g; each value is q + 32. 26.5 bytes per 32 weights
# with the scales. The kernels widen a unit in registers (native.c six_quads256 / six_byte), or a
# whole tile once for a prompt (widen_tile); the integer dots are the 8-bit layout's, so every
# product keeps its bits.
SIX_BLOCKS = 3


def is_six(qv):
    """Whether the int8 layout qv holds 6-bit units (NOTE(q6))."""
    return qv.ndim == 6 and qv.shape[3] == SIX_BLOCKS


def _six_fits(p):
    """A Q6_K weight (q8 in units of 16 under K-quant super scales) whose values all fit 6 bits."""
    if p.kind != "q8" or p.ds is None or p.qs.shape[1] != p.d.shape[1]:
        return False
    q = p.qs
    return bool(q.min() >= -32 and q.max() <= 31)


def _narrow(qv):
    """The 6-bit blocks (SIX_BLOCKS at axis 3) of an 8-bit layout qv (q + 128, 4 quads at axis 3)."""
    v = qv - np.uint8(96)                                               # q + 32: 0..63
    lo, top = v & np.uint8(15), v >> np.uint8(4)
    blocks = [lo[:, :, :, 0] | lo[:, :, :, 2] << np.uint8(4), lo[:, :, :, 1] | lo[:, :, :, 3] << np.uint8(4),
              top[:, :, :, 0] | top[:, :, :, 1] << np.uint8(2) | top[:, :, :, 2] << np.uint8(4)
              | top[:, :, :, 3] << np.uint8(6)]
    return np.ascontiguousarray(np.stack(blocks, axis=3))


def widen(b, axis=3):
    """6-bit blocks (SIX_BLOCKS at `axis`) back to the 8-bit layout's 4 quads, q + 128 (NOTE(q6))."""
    n0, n1, hb = (np.take(b, i, axis=axis) for i in range(SIX_BLOCKS))
    lows = (n0 & np.uint8(15), n1 & np.uint8(15), n0 >> np.uint8(4), n1 >> np.uint8(4))
    quads = [lo | ((hb >> np.uint8(2 * g)) & np.uint8(3)) << np.uint8(4) for g, lo in enumerate(lows)]
    return np.stack(quads, axis=axis) + np.uint8(96)


def unprepare(p):
    """QWeight p's tiled blocks (`qs`: [T, k/32 or k/16, 16, tile]) rebuilt from its int8 layout
    `qv`, the inverse of `prepare`."""
    qv = widen(p.qv) if is_six(p.qv) else p.qv
    T, nu, chunks, quads = qv.shape[:4]
    q = qv.transpose(0, 1, 3, 5, 2, 4).reshape(T, nu * quads // 4, 16, chunks * LANES)
    return np.ascontiguousarray(q) if p.kind == "q4" else (q ^ np.uint8(128)).view(np.int8)


def block_rows(p, t, r):
    """Rows (tile t [N], lane r [N]) of QWeight p as quant.Blocks.q holds them, read from `qv`:
    q4 uint8 [N, k/32, 16], q8 int8 [N, k/16, 16]. Only those rows are gathered (a token lookup
    every step: PERF(embed))."""
    b = p.qv[t, :, r // LANES, :, r % LANES]                        # [N, nu, quads, 4]
    if is_six(p.qv):
        b = widen(b, axis=2)
    b = b.reshape(len(t), -1, 16)
    return b if p.kind == "q4" else (b ^ np.uint8(128)).view(np.int8)


# ---------------------------------------------------------------------------- reference

def dequantize_blocks(b, rows=None):
    """Blocks (optionally only `rows`) -> float32 [n, k]."""
    q, d, m = b.q, b.d, b.m
    if rows is not None:
        q, d, m = q[rows], d[rows], None if m is None else m[rows]
    n = q.shape[0]
    if b.kind == "q4":
        v = np.concatenate([q & 15, q >> 4], axis=-1).astype(np.float32)   # [n, nb, 32]
        return (v * d[..., None] + m[..., None]).reshape(n, -1)
    group = q.shape[1] // d.shape[1]
    v = q.astype(np.float32).reshape(n, d.shape[1], group * SUB)
    return (v * d[..., None]).reshape(n, -1)


def dequantize(w):
    """QWeight or QMatrix -> float32 [n, k]."""
    if isinstance(w, QMatrix):
        return np.concatenate([dequantize(p) for p in w.parts])
    return dequantize_blocks(untile(w))


def matmul_ref(x, w):
    """The exact float32 reference: x [B, k] @ dequantize(w).T -> [B, n]."""
    return np.asarray(x, dtype=np.float32) @ dequantize(w).T


def _block_rows(p, t, r):
    """The blocks of rows (tile t, lane r) of QWeight p as Blocks.q holds them, read from whichever
    layout p keeps (a token lookup must not rebuild qs from qv: NOTE(one-layout))."""
    return p.tiled[t, ..., r] if p.tiled is not None else block_rows(p, t, r)


def embed_rows(w, ids):
    """Rows `ids` of a QMatrix (e.g. a tied token embedding) as float32 [len(ids), k]."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    out = np.empty((len(ids), w.k), np.float32)
    start = 0
    for p in w.parts:
        sel = (ids >= start) & (ids < start + p.n)
        if sel.any():
            local = ids[sel] - start
            t, r = local // p.tile, local % p.tile
            out[sel] = dequantize_blocks(Blocks(p.kind, _block_rows(p, t, r), *p.lane_scales(t, r)))
        start += p.n
    return out
