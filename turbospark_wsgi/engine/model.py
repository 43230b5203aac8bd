"""The transformer forward pass (llama family), written against an array module `xp`."""
import numpy as np

from . import layer_variants, yielding
from .attention import Attention, RotaryTables, rope
from .kernels import cpu as kernels_cpu, layer as kernels_layer
from .backend import to_host
from .exact_rows import plain_matmul, rows_matmul
from .kv_cache import KVCache
from .lora import RowLora
from .options import EngineOptions, kernel_plan

# PERF(prefill): a prompt of at most this many tokens runs on the fast few-row kernels instead (padded
# to exact_rows.ROW_FLOOR rows on the GEMM path a one-token prompt measured 137 ms against 22 ms); its
# rows are simply never reused. Longer prompts never make a call this short: a short tail joins the
# piece before.
SMALL_WINDOW = 16


class Transformer:
    """A decoder-only transformer: RMSNorm, rotary attention with GQA, SwiGLU, tied or separate head.

    Its layers are `DecoderLayers.run`, the readable specification; each call runs it or one of
    its registered variants (the C or numba layer kernels, the device kernels), whichever
    layer_variants.choose picks: `variant` says which."""

    kernels = None      # the device kernels (gpu/launch.py) the layers' steps run on, or None

    def __init__(self, cfg, weights, xp, plan=None):
        self.cfg, self.w, self.xp = cfg, weights, xp
        self.plan = plan or kernel_plan(EngineOptions())       # the CPU kernels this model runs
        self.rotary = RotaryTables(cfg, weights.rope_freqs, xp)
        self.attention = Attention(xp, kernel=self.fused_attention, native=self.native)
        self._layer_window = [cfg.layer_window(i) for i in range(cfg.n_layer)]   # 0: global attention
        self.layers = DecoderLayers(cfg, weights, xp)        # the step-by-step path
        self._rows_exact = None
        self._layer_args = None     # kernels_layer.layer_args of every layer, built on first use; False: none
        self._native_layers = None  # their C views (native.Library.layer_weights), built on first use
        self._numba_args = None     # numba's layer arguments (kernels_layer.numba_args), built on first use

    @property
    def variant(self):
        """The layer_variants.Variant that runs this call's layers."""
        return layer_variants.choose(self)

    @property
    def fused(self):
        """Whether this call runs each layer as one kernel call (the "native" or "numba" variant):
        prompts and decode steps alike, so positions keep the same bits either way they were computed."""
        return self.variant.fused

    def layer_window(self, i):
        """Layer i's sliding window in positions (0: global attention)."""
        return self._layer_window[i]

    @property
    def native(self):
        """The C kernels (kernels/native.py) this model's CPU kernels run on, or None (numba's)."""
        return self.plan.native if self.xp is np else None

    @property
    def fused_attention(self):
        """Whether attention runs on the CPU kernel that computes every row on its own (numpy
        backend with numba), the same for prompt rows and decode rows (`self.attention` is built
        on this choice)."""
        return self.xp is np and kernels_cpu.AVAILABLE

    @property
    def rows_exact(self):
        """Whether `forward` gives every prompt position the same K/V bits however the prompt was
        cut into calls, so a cached prefix of any length can be reused exactly.

        NOTE(exact-prefix): by construction the attention of position p always reads the keys up
        to the end of p's aligned block, and the products go through `rows_matmul`; what is left is
        BLAS, whose per-row results are checked once here on this model's shapes. CuPy (cuBLAS picks
        kernels by shape) is not trusted: there only whole aligned chunks are reused."""
        if self._rows_exact is None:
            self._rows_exact = self.xp is np and _probe_rows_exact(self)
        return self._rows_exact

    @property
    def decode_exact(self):
        """Whether a decode step gives its position the K/V bits a prefill gives it, so a reply's
        tokens can be reused like prompt tokens: every product runs on the quantized kernels
        (whose rows never depend on the call) and attention on the fused kernel."""
        products = [getattr(lw, n) for lw in self.w.layers for n in ("wqkv", "wo", "w_gate_up", "w_down")]
        return self.fused_attention and self.rows_exact and all(hasattr(w, "matmul_rows") for w in products)

    @property
    def kv_dtype(self):
        """What a new KV cache holds: KernelPlan.kv_dtype's numbers where layers are fused, else float32."""
        return self.plan.kv_dtype(self.cfg.head_dim) if self.fused else np.float32

    def new_cache(self, max_seq=None):
        """An empty KVCache for up to `max_seq` positions (default: the model's context length)."""
        c = self.cfg
        return KVCache(c.n_layer, max_seq or c.max_seq_len, c.n_kv_head, c.head_dim, self.xp, self.kv_dtype)

    def forward(self, tokens, cache, logits="last", row_exact=False, adapter=None):
        """Runs `tokens` (ids) at positions cache.length.. and advances cache.length by len(tokens).
        Returns host float32 logits: "last" -> [vocab], "all" -> [T, vocab], "none" -> None.
        "hidden" -> [T, dim]: every position's final-normed hidden state, before the head (embeddings).
        `row_exact` runs the products on `rows_matmul`, so each position's K/V bits do not depend on
        how the prompt was cut into calls (where `rows_exact`); `adapter`: a lora.LoraAdapter or None."""
        c, w, xp = self.cfg, self.w, self.xp
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T, pos = len(ids), cache.length
        if logits not in ("last", "all", "none", "hidden"):
            raise ValueError(f"logits must be 'last', 'all', 'none' or 'hidden', not {logits!r}")
        if T == 0 or pos + T > cache.max_seq:
            raise ValueError(f"cannot run {T} tokens at position {pos} with a cache of {cache.max_seq}")
        x, lora = self._embed(ids), RowLora.of(self, [adapter] * T)    # [T, dim]; NOTE(lora-path): lora.py
        variant = self.variant
        if variant.fused and lora is None:
            self._fused_layers(variant, x, np.zeros(T, np.int64), np.arange(pos, pos + T, dtype=np.int64), [cache], [pos + T])
        else:
            self._prompt_layers(x, pos, cache, rows_matmul if row_exact else plain_matmul, lora)
        cache.length = pos + T
        if logits == "none":
            return None
        if logits == "hidden":
            return to_host(rms_norm(x, w.norm, c.norm_eps, xp))        # [T, dim]
        x = x[-1:] if logits == "last" else x                           # [1 or T, dim]
        out = soft_cap(to_host(rms_norm(x, w.norm, c.norm_eps, xp) @ w.head), c.final_softcap)   # [1 or T, vocab]
        return out[0] if logits == "last" else out

    def _prompt_layers(self, x, pos, cache, mm, lora=None):
        """`forward`'s layers step by step on x `[T, dim]` (in place) at positions pos.., products by `mm`."""
        H, G, T = self.cfg.n_head, self.cfg.n_kv_head, len(x)
        span = self.attention.span(pos + T)

        def attend(i, qk, qkv):
            keys, vals = cache.update(i, pos, qk[:, H:], qkv[:, H + G:], span)  # [<=span, G, D] each
            return self.attention.prompt(qk[:, :H], keys, vals, pos, self._layer_window[i])   # [T, H*D]
        self.layers.run(x, self.rotary.layers(pos + T, slice(pos, pos + T)), mm, attend, lora)

    def decode_batch(self, tokens, caches, adapters=None):
        """One decode step for B rows: token b runs at the next free position of caches[b], which
        advances. A cache listed n times takes n rows at consecutive positions (in list order): a
        sequence's speculative tokens, verified in one step. Row b adds LoRA adapters[b] (None: none).
        Returns host float32 logits [B, vocab].

        NOTE(exact-batching): every matmul is a stack of B single-row products and attention runs
        per row, so row b is bit-for-bit what a batch of one computes: batching never changes a
        sequence's output, and a row among its own sequence's next rows is what that decode step
        alone computes."""
        c, w, xp = self.cfg, self.w, self.xp
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        own, ends, seq, pos = placed = _placed(caches)
        adapters = list(adapters or ()) or [None] * len(ids)
        for cache, end in zip(own, ends):
            cache.reserve(end)          # before any row's K/V is written: growing keeps only `length`
        variant = self.variant
        x = self._fused_decode(variant, ids, caches, adapters, placed) if variant.fused else \
            self._decode_layers(ids, pos, caches, RowLora.of(self, adapters))         # [B, 1, dim]
        for cache, end in zip(own, ends):
            cache.length = end
        return soft_cap(to_host(rms_norm(x, w.norm, c.norm_eps, xp) @ w.head)[:, 0], c.final_softcap)   # [B, vocab]

    def _fused_decode(self, variant, ids, caches, adapters, placed=None):
        """`decode_batch`'s layers, fused -> x `[B, 1, dim]`; adapter rows step by step beside them (NOTE(lora-path))."""
        base, runs = ([b for b, a in enumerate(adapters) if (a is None) == want] for want in (True, False))
        if not runs:                    # the usual step: every row fused, placed by decode_batch
            own, ends, seq, pos = placed or _placed(caches)
            return self._fused_layers(variant, self._embed(ids), np.asarray(seq, np.int64), np.asarray(pos, np.int64),
                                      own, ends)[:, None]
        x = np.empty((len(ids), 1, self.cfg.dim), np.float32)
        if base:
            x[base] = self._fused_decode(variant, ids[base], [caches[b] for b in base], [None] * len(base))
        rows = [caches[b] for b in runs]
        x[runs] = self._decode_layers(ids[runs], _placed(rows)[3], rows, RowLora([adapters[b] for b in runs], self.xp))
        return x

    def _decode_layers(self, ids, pos, caches, lora=None):
        """`decode_batch`'s layers step by step: token b at position pos[b] of caches[b] -> x `[B, 1, dim]`.
        Each product is a stack of single-row products (NOTE(exact-batching)), LoRA terms too."""
        at = self.xp.asarray(np.asarray(pos, dtype=np.int64))
        state = self._decode_state(pos, caches)
        return self.layers.run(self._embed(ids)[:, None, :], self.rotary.layers(max(pos) + 1, at), plain_matmul,
                               lambda i, qk, qkv: self._decode_attend(i, qk, qkv, pos, caches, state), lora)

    def _decode_state(self, pos, caches):
        """What a decode step's attention needs beyond the caches, made once per step (none here)."""
        return None

    def _decode_attend(self, i, qk, qkv, pos, caches, state):
        """Layer i of a decode step: each row's new K/V (qk[:, H:], qkv[:, H+G:]) stored at pos[b] of
        caches[b], and its rotated query heads qk[:, :H] over them -> `[B, 1, H*D]`."""
        H, G = self.cfg.n_head, self.cfg.n_kv_head
        att = self.xp.empty((len(caches), 1, H * self.cfg.head_dim), dtype=qk.dtype)
        for b, cache in enumerate(caches):
            keys, vals = cache.update(i, pos[b], qk[b:b + 1, H:], qkv[b:b + 1, H + G:])
            att[b] = self.attention.decode(qk[b:b + 1, :H], keys, vals, pos[b], self._layer_window[i])
        return att

    def _fused_layers(self, variant, x, seq, at, caches, ends):
        """Runs every layer on x `[R, dim]` (in place) as one kernel call each of the fused `variant`
        (its `run`): row r is position at[r] of caches[seq[r]], whose K/V it stores;
        caches[s] is first made to hold ends[s] positions. Returns x."""
        for cache, end in zip(caches, ends):
            cache.reserve(int(end))
        kv, elem = kernels_layer.addresses(caches)
        ropes = self.rotary.layers(int(at.max()) + 1)
        self.w.layers[0].wqkv.use_threads(len(x))
        return variant.run(self, x, seq, at, kv, elem, ropes)

    def _embed(self, ids):
        w, xp = self.w, self.xp
        ids = xp.asarray(ids)
        if w.tok_embd is not None:
            x = w.tok_embd[ids]                                         # [T, dim]
        else:
            x = xp.ascontiguousarray(w.head[:, ids].T)                  # tied: columns of the head
        if self.cfg.embed_scale:
            x = x * np.float32(np.sqrt(self.cfg.dim))                   # Gemma: times sqrt(dim)
        return x


def soft_cap(logits, cap):
    """Final logit soft-capping (cap * tanh(logits / cap)) where the config sets a cap."""
    if not cap:
        return logits
    return (np.tanh(logits / np.float32(cap)) * np.float32(cap)).astype(np.float32)


def _placed(caches):
    """A decode step's rows by their caches (a cache listed n times: n rows at consecutive
    positions): (the distinct caches, the length each will have, each row's index among them, its position)."""
    own, ends, seq, pos = [], [], [], []
    for cache in caches:
        s = next((i for i, o in enumerate(own) if o is cache), len(own))
        if s == len(own):
            own.append(cache)
            ends.append(cache.length)
        seq.append(s)
        pos.append(ends[s])
        ends[s] += 1
    return own, ends, seq, pos


class DecoderLayers:
    """The specification of a decoder layer (layer_variants.py registers the code that must equal
    it), step by step in the array module `xp`: RMSNorm, the q|k|v heads (with the
    architecture's biases and q/k norms), rotary, an attention the caller gives, the output
    projection, the gated MLP, post norms where the architecture has them, and the residuals.
    Every other step is row-wise: a row's bits depend on the rows beside it only through the
    products `mm` and the attention.

    The Transformer runs prompts and decode steps through it unless a fused variant (the same steps
    in one C or numba call per layer) runs the call."""

    def __init__(self, cfg, weights, xp):
        self.cfg, self.weights, self.xp = cfg, weights, xp
        # the row-wise steps, which a backend may replace with kernels of its own (gpu/model.py)
        self.norm = lambda x, weight, eps: rms_norm(x, weight, eps, xp)
        self.gate = lambda gu, ffn_dim, gelu: (gelu_tanh_gate if gelu else swiglu)(gu, ffn_dim, xp)
        self.rope = lambda x, cos, sin, rot: rope(x, cos, sin, rot, xp)

    def run(self, x, ropes, mm, attend, lora=None):
        """Every layer on x `[R, dim]` or `[R, 1, dim]` (in place), products by `mm`:
        `ropes[i]` rotates layer i's q and k heads, `attend(i, qk, qkv)` stores layer i's new K/V
        and returns its attention `[R, H*D]` or `[R, 1, H*D]`; `lora` (a lora.RowLora or None) adds
        each row's adapter terms to the products. Returns x."""
        c, xp = self.cfg, self.xp
        H, G = c.n_head, c.n_kv_head

        def product(i, name, h, w):
            y = mm(h, w, xp)
            return y if lora is None else lora.add(i, name, h, y)
        for i, lw in enumerate(self.weights.layers):
            yielding.point()                                            # NOTE(front-door): see yielding.py
            h = self.norm(x, lw.attn_norm, c.norm_eps)
            qkv = self._heads(product(i, "wqkv", h, lw.wqkv), lw, len(x))   # [R, H+2G, D]  q|k|v heads
            qk = self.rope(qkv[:, :H + G], *ropes[i], c.rope_dim)       # [R, H+G, D]
            x += self._post(product(i, "wo", attend(i, qk, qkv), lw.wo), lw.post_attn_norm)   # residual
            h = self.norm(x, lw.ffn_norm, c.norm_eps)
            g = self._gate(product(i, "w_gate_up", h, lw.w_gate_up))    # [R, (1,) ffn_dim]
            x += self._post(product(i, "w_down", g, lw.w_down), lw.post_ffn_norm)     # residual
        return x

    def _heads(self, qkv, lw, rows):
        """The q|k|v product `[rows, (H+2G)*D]` (any leading shape) as heads `[rows, H+2G, D]`, with
        the architecture's biases added and q/k heads RMS-normed where it has them.

        NOTE(exact-prefix): both steps are elementwise or reduce over one head of one row, so a
        position's bits stay independent of the rows computed with it."""
        c, xp = self.cfg, self.xp
        H, G = c.n_head, c.n_kv_head
        if lw.bqkv is not None:
            qkv = qkv + lw.bqkv
        qkv = qkv.reshape(rows, H + 2 * G, c.head_dim)
        if lw.q_norm is not None:
            qkv[:, :H] = self.norm(qkv[:, :H], lw.q_norm, c.norm_eps)
            qkv[:, H:H + G] = self.norm(qkv[:, H:H + G], lw.k_norm, c.norm_eps)
        return qkv

    def _post(self, y, norm):
        """A sub-layer's output as added to the residual: RMS-normed where the architecture has
        post norms (row-wise, like every step here)."""
        return y if norm is None else self.norm(y, norm, self.cfg.norm_eps)

    def _gate(self, gu):
        """The MLP's gated activation of gate|up: SiLU, or GELU (tanh) for Gemma."""
        c = self.cfg
        return self.gate(gu, c.ffn_dim, c.gelu_gate)


def _probe_rows_exact(model, rows=128):
    """Checks rows_matmul on this model's product shapes: rows taken a few at a time must equal
    the same rows of one whole product, bit for bit (attention's too, unless the fused kernel,
    exact by construction, runs it)."""
    c, lw = model.cfg, model.w.layers[0]
    rng = np.random.default_rng(0)
    cases = [(rng.standard_normal((rows, w.shape[0]), dtype=np.float32), w)
             for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
    cases += model.attention.row_cases(c, rng)
    for x, w in cases:
        whole = rows_matmul(x, w, np)
        for a, m in ((0, 1), (5, 3), (40, 17), (7, 31), (50, 46), (1, rows - 1)):
            if not np.array_equal(rows_matmul(x[..., a:a + m, :], w, np), whole[..., a:a + m, :]):
                return False
    return True


def rms_norm(x, weight, eps, xp):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis. x: [T, dim]."""
    # PERF(norm): in-place steps on the [T, 1] column; half the time of mean() + temporaries at T=1
    rms = xp.square(x).sum(axis=-1, keepdims=True)                     # [T, 1]
    rms *= 1.0 / x.shape[-1]
    rms += eps
    xp.sqrt(rms, out=rms)
    out = x / rms                                                      # [T, dim]
    out *= weight
    return out


def swiglu(gu, ffn_dim, xp):
    """silu(gate) * up for gu = [T, 2*ffn_dim] (gate | up). silu(g) = t * (1 + tanh(t)), t = g/2:
    the same function as g * sigmoid(g), without exp overflow for very negative g."""
    t = gu[..., :ffn_dim] * 0.5                                        # [T, F]
    a = xp.tanh(t)
    a += 1.0
    a *= t
    a *= gu[..., ffn_dim:]
    return a


def gelu_tanh_gate(gu, ffn_dim, xp):
    """gelu_tanh(gate) * up for gu = [T, 2*ffn_dim] (gate | up): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))."""
    g = gu[..., :ffn_dim]                                              # [T, F]
    a = g * g
    a *= np.float32(0.044715)
    a += 1.0
    a *= g
    a *= np.float32(np.sqrt(2.0 / np.pi))
    xp.tanh(a, out=a)
    a += 1.0
    a *= g
    a *= 0.5
    a *= gu[..., ffn_dim:]
    return a
