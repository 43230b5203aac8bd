"""The C kernels' scratch (native.c, NOTE(scratch)): one block per calling thread, grown and reused,
gives every call the bits of a call on fresh memory; an allocation that fails is a MemoryError
naming the kernel, after which nothing was written and the next call runs; and every allocation in
the source goes through the one checked helper."""
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from turbospark_wsgi.engine.kernels import cpu as kernels_cpu, isa, native

pytest.importorskip("gguf")
from test_quant_kernels import make  # noqa: E402

pytestmark = pytest.mark.skipif(native.compiler() is None or not kernels_cpu.AVAILABLE,
                                reason="no C compiler, or numba is absent")
# the paths this machine runs, on this architecture's C build (test_native_kernels.py's)
PATHS = [p for p in isa.runnable(isa.host_features()) if p != "neon" or os.uname().machine in ("aarch64", "arm64")]
PATH = PATHS[0]


@pytest.fixture(scope="module")
def lib():
    return native.load(PATH)


@pytest.fixture(scope="module", params=PATHS)
def each(request):
    return native.load(request.param)


@pytest.fixture(scope="module")
def weight():
    w, ref = make("Q4_1", 96, 8)
    return w.parts[0], ref.shape[1]


def _product(lib, p, k, B, kind="i8", seed=0):
    x = np.random.default_rng(seed + B).standard_normal((B, k)).astype(np.float32)
    y = np.full((B, p.qs.shape[0] * p.tile), np.nan, np.float32)
    (lib.product_i8 if kind == "i8" else lib.product_f32)(x, p, y, 2)
    return y


def _attention_case(depth, R, seed=0):
    rng = np.random.default_rng(seed + depth + R)
    H, G, D = 6, 2, 40
    keys = rng.standard_normal((1, depth + R, G, D)).astype(np.float16)
    vals = rng.standard_normal((1, depth + R, G, D)).astype(np.float16)
    kv = np.array([[keys.ctypes.data, vals.ctypes.data, depth + R]], np.int64)
    q = (rng.standard_normal((R, (H + 2 * G) * D)) * 0.3).astype(np.float32)
    seq, pos = np.zeros(R, np.int64), np.arange(depth, depth + R, dtype=np.int64)
    return (keys, vals), (q, seq, pos, kv, True, 0, 0, H, G, D)


def _attend(lib, depth, R):
    keep, args = _attention_case(depth, R)
    out = np.full((R, args[7] * args[9]), np.nan, np.float32)
    lib.attend_rows(*args, out, 2)
    return out


def _fresh(lib, fn, *args):
    lib.release_scratch()
    return fn(lib, *args)


# ---- (a) a block grown and reused gives fresh memory's bits ------------------------------------

SHAPES = [1, 40, 3, 64, 1, 7]       # rows: growing, then shrinking, then growing again


@pytest.mark.parametrize("kind", ["i8", "f32"])
def test_products_on_a_reused_block_give_fresh_memorys_bits(each, weight, kind):
    lib, (p, k) = each, weight
    fresh = {B: _fresh(lib, _product, p, k, B, kind) for B in set(SHAPES)}
    lib.release_scratch()
    sizes = []
    for B in SHAPES:
        assert np.array_equal(_product(lib, p, k, B, kind), fresh[B]), B
        sizes.append(lib.scratch_bytes())
    assert sizes == sorted(sizes) and sizes[0] > 0      # grown on demand, never shrunk
    lib.release_scratch()
    assert lib.scratch_bytes() == 0


def test_attention_on_a_reused_block_gives_fresh_memorys_bits(each):
    lib = each
    # (depth, rows): a few blocks' tasks are their chunks, 16 blocks' or more (G = 2) the blocks
    cases = [(0, 1), (1000, 1), (300, 64), (400, 130), (600, 2), (10, 9), (1200, 40), (0, 1), (0, 200)]
    fresh = {c: _fresh(lib, _attend, *c) for c in set(cases)}
    lib.release_scratch()
    for c in cases:
        assert np.array_equal(_attend(lib, *c), fresh[c]), c


def _model_steps(model, release=None):
    """Logits of prompts and decode steps whose row counts and depths grow, shrink and grow again."""
    rng = np.random.default_rng(3)
    caches = [model.new_cache(300) for _ in range(3)]
    out = []
    for cache, n in ((caches[0], 5), (caches[1], 150), (caches[2], 2)):
        release and release()
        out.append(model.forward(rng.integers(3, 200, n).tolist(), cache, logits="last")[None])
    for rows in ([0, 1, 2], [1], [0, 2], [2], [0, 1, 2]):
        release and release()
        out.append(model.decode_batch(rng.integers(3, 200, len(rows)).tolist(), [caches[r] for r in rows]))
    return np.concatenate(out)


@pytest.mark.parametrize("path", PATHS)
def test_layers_on_a_reused_block_give_fresh_memorys_bits(tiny_gguf, path):
    from turbospark_wsgi.engine.loader import load_model
    model = load_model(tiny_gguf(qtype="Q8_0").path, device="cpu", kernels="native", int8_isa=path,
                       activations="int8").model
    lib = model.native
    assert lib is not None
    lib.release_scratch()
    reused = _model_steps(model)
    assert np.array_equal(reused, _model_steps(model, release=lib.release_scratch))


def test_each_calling_thread_has_its_own_block(lib, weight):
    """ctypes lets go of the GIL: threads calling at once must not share buffers."""
    p, k = weight
    want = {B: _fresh(lib, _product, p, k, B) for B in (1, 40)}
    attn = {c: _fresh(lib, _attend, *c) for c in ((700, 1), (64, 30))}
    lib.release_scratch()
    assert lib.scratch_bytes() == 0
    wrong, seen = [], []

    def work(i):
        seen.append(lib.scratch_bytes())
        for n in range(30):
            B = (1, 40)[(i + n) % 2]
            c = ((700, 1), (64, 30))[(i + n) % 2]
            if not np.array_equal(_product(lib, p, k, B), want[B]) or not np.array_equal(_attend(lib, *c), attn[c]):
                wrong.append((i, n))

    _product(lib, p, k, 40)                 # this thread's block, which the others must not see
    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and seen == [0, 0, 0]


# ---- (b) an allocation that fails is a MemoryError; nothing was written; the next call runs ------

def test_a_failed_allocation_raises_memoryerror_naming_the_kernel_and_writes_nothing(lib, weight):
    p, k = weight
    x = np.random.default_rng(1).standard_normal((4, k)).astype(np.float32)
    want = _fresh(lib, _product, p, k, 4)
    keep, args = _attention_case(500, 3)
    calls = {"ts_product_i8": lambda y: lib.product_i8(x, p, y, 2),
             "ts_product_f32": lambda y: lib.product_f32(x, p, y, 2),
             "ts_attend_rows": lambda y: lib.attend_rows(*args, y, 2)}
    for name, call in calls.items():
        y = np.full((4, p.qs.shape[0] * p.tile) if name != "ts_attend_rows" else (3, 6 * 40), 7.0, np.float32)
        lib.release_scratch()
        lib.fail_next_alloc(1)
        with pytest.raises(MemoryError, match=rf"C kernel {name} could not allocate its scratch memory \(\d+ bytes\)"):
            call(y)
        assert (y == 7.0).all(), name                   # it did nothing
        assert lib.scratch_bytes() == 0
        call(y)                                         # the next call gets its memory
        assert not (y == 7.0).all(), name
    assert np.array_equal(_product(lib, p, k, 4), want)


def test_the_nth_allocation_from_now_fails(lib, weight):
    p, k = weight
    lib.release_scratch()
    lib.fail_next_alloc(2)
    _product(lib, p, k, 2)                  # the first allocation
    _product(lib, p, k, 2)                  # fits the block: none
    with pytest.raises(MemoryError):
        _product(lib, p, k, 50)             # grows: the second
    assert np.array_equal(_product(lib, p, k, 50), _fresh(lib, _product, p, k, 50))
    lib.fail_next_alloc(0)


def test_a_layer_that_cannot_allocate_leaves_x_and_the_cache_and_the_engine_runs_on(tiny_gguf):
    from turbospark_wsgi.engine import SamplingParams, Token, load_engine
    from turbospark_wsgi.engine.kernels import layer as kernels_layer
    engine = load_engine(str(tiny_gguf(qtype="Q8_0").path), device="cpu", kernels="native", int8_isa=PATH,
                         activations="int8")
    model, lib = engine.model, engine.model.native

    def tokens():
        return [e.id for e in engine.generate([5, 9, 11, 40, 3], SamplingParams(max_new_tokens=6, temperature=0))
                if isinstance(e, Token)]

    want = tokens()
    cache = model.new_cache(16)
    cache.reserve(8)
    kv, elem = kernels_layer.addresses([cache])
    cos, sin = model.rotary.layers(3)[0]
    x = np.random.default_rng(0).standard_normal((3, model.cfg.dim)).astype(np.float32)
    x0, k0, v0 = x.copy(), cache.k.copy(), cache.v.copy()
    lib.release_scratch()
    lib.fail_next_alloc(1)
    with pytest.raises(MemoryError, match="C kernel ts_layer"):
        lib.layer(model._native_layers[0], x, np.zeros(3, np.int64), np.arange(3), kv, elem.dtype == np.uint16, 0, 0,
                  cos, sin, 2)
    assert np.array_equal(x, x0) and np.array_equal(cache.k, k0) and np.array_equal(cache.v, v0)
    lib.release_scratch()
    lib.fail_next_alloc(1)
    with pytest.raises(MemoryError, match="C kernel ts_layer"):
        tokens()
    assert tokens() == want                         # the same engine, the same tokens


def test_release_scratch_frees_the_calling_threads_blocks_of_every_loaded_library(lib, weight):
    p, k = weight
    _product(lib, p, k, 8)
    assert lib.scratch_bytes() > 0
    native.release_scratch()
    assert lib.scratch_bytes() == 0
    from turbospark_wsgi import engine
    assert engine.release_scratch is native.release_scratch


# ---- (c) one allocation, checked ---------------------------------------------------------------

def _function_bodies(code):
    """{name: body} of the C functions defined at the top level of `code` (no comments; braces matched)."""
    head = re.compile(r"^[A-Za-z_][\w \t\*]*?\b(\w+)\s*\([^;{]*\)\s*\{", re.M)
    bodies, at = {}, 0
    while m := head.search(code, at):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        bodies[m.group(1)] = code[m.end():i - 1]
        at = i
    return bodies


def test_every_allocation_goes_through_the_one_checked_helper():
    source = Path(native.SOURCE).read_text()
    code = re.sub(r"/\*.*?\*/|//[^\n]*", "", source, flags=re.S)     # no comments
    alloc = re.compile(r"\b(malloc|calloc|realloc|reallocarray|aligned_alloc|posix_memalign|memalign|valloc|pvalloc|"
                       r"alloca|strdup|strndup|mmap)\s*\(")
    found = [(m.group(1), code[:m.start()].count("\n") + 1) for m in alloc.finditer(code)]
    assert len(found) == 1 and found[0][0] == "aligned_alloc", found
    bodies = _function_bodies(code)
    holder = [name for name, body in bodies.items() if alloc.search(body)]
    assert holder == ["scratch_reserve"], holder
    body = bodies["scratch_reserve"]
    assert re.search(r"if \(p == NULL\)\s*\{[^}]*return TS_NOMEM;", body), "the allocation's result is not checked"
    assert [n for n, b in bodies.items() if re.search(r"\bfree\s*\(", b)] == ["scratch_drop"]
    callers = [n for n, b in bodies.items() if re.search(r"\bscratch_reserve\s*\(", b)]
    assert callers == ["scratch_begin"], callers
    # every kernel that takes scratch returns its status, and native.py checks it
    users = sorted(n for n, b in bodies.items() if n.startswith("ts_") and "scratch_begin" in b)
    assert users == ["ts_attend_rows", "ts_layer", "ts_product_f32", "ts_product_i8"]
    assert all(re.search(rf"^int {n}\(", code, re.M) for n in users)
    wrapper = Path(native.__file__).read_text()
    assert all(re.search(rf"self\._check\(self\._lib\.{n}\(.*?\"{n}\"\)", wrapper, re.S) for n in users)
