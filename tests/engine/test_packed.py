"""Packed weights (engine/packed.py): the int8 layout written once into the weight cache and mapped by
every later load, giving the same numbers as a private build; and the one-layout QWeight (quant,
NOTE(one-layout)): qs rebuilt from qv exactly, token rows read from qv."""
import errno
import fcntl
import os
import threading

import numpy as np
import pytest

from turbospark_wsgi.config import Config, weight_cache_dir
from turbospark_wsgi.engine import packed, quant
from turbospark_wsgi.engine.kernels import cpu as kernels_cpu, int8, native
from turbospark_wsgi.engine.loader import load_model

pytestmark = pytest.mark.skipif(not kernels_cpu.AVAILABLE, reason="the block kernels need numba")
from test_native_kernels import k_quant_llama  # noqa: E402

PROMPT = [1, 5, 9, 3, 7, 11, 4, 8, 2, 6]


def _logits(loaded):
    return np.asarray(loaded.model.forward(PROMPT, loaded.model.new_cache(32), logits="all"))


def _bins(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".bin"))


def _load(path, cache, **kw):
    return load_model(path, device="cpu", activations="int8", weight_cache=str(cache) if cache else "", **kw)


@pytest.mark.parametrize("qtype,tied", [("Q4_0", False), ("Q8_0", True), ("Q4_1", True)])
def test_a_packed_file_is_written_once_then_mapped_with_the_same_numbers(tiny_gguf, tmp_path, qtype, tied):
    model = tiny_gguf(qtype, tied=tied)
    cache = tmp_path / "weights"
    private = _load(model.path, None)
    assert private.weights.startswith("weights held by this process")
    written = _load(model.path, cache)
    assert "packed into the shared weight cache" in written.weights
    mapped = _load(model.path, cache)
    assert mapped.weights == "weights mapped from the shared weight cache"
    want = _logits(private)
    assert np.array_equal(_logits(written), want)
    assert np.array_equal(_logits(mapped), want)
    assert len(_bins(cache)) == 1 and not [n for n in os.listdir(cache) if n.endswith(".tmp")]


@pytest.mark.parametrize("kernels", ["native", "numba"])
def test_each_fused_layer_runs_on_mapped_read_only_weights_as_on_built_ones(tiny_gguf, tmp_path, kernels):
    """The mapped blocks are read-only where a freshly built layout is writable; numba's layer takes
    its parts as one tuple type whichever it gets (kernels/layer.py numba_args)."""
    if kernels == "native" and native.compiler() is None:
        pytest.skip("no C compiler")
    path, cache = k_quant_llama(tiny_gguf), tmp_path / "weights"
    private, written = _load(path, None, kernels=kernels), _load(path, cache, kernels=kernels)
    mapped = _load(path, cache, kernels=kernels)
    assert mapped.weights == "weights mapped from the shared weight cache" and mapped.model.variant.name == kernels
    want = _logits(private)
    assert np.array_equal(_logits(written), want) and np.array_equal(_logits(mapped), want)


def test_mapped_weights_hold_only_the_int8_layout_read_only(tiny_gguf, tmp_path):
    model = tiny_gguf("Q4_0")
    _load(model.path, tmp_path)
    mapped = _load(model.path, tmp_path)
    for w in (mapped.model.w.layers[0].wqkv, mapped.model.w.layers[1].w_down, mapped.model.w.head):
        for p in w.w.parts:
            assert p.tiled is None and p.qv is not None
            assert not p.qv.flags.writeable and not p.d.flags.writeable


@pytest.mark.parametrize("damage", ["truncate", "trailer", "offsets", "empty"])
def test_a_damaged_packed_file_is_rebuilt_never_trusted(tiny_gguf, tmp_path, damage):
    model = tiny_gguf("Q8_0")
    want = _logits(_load(model.path, tmp_path))
    (name,) = _bins(tmp_path)
    path = tmp_path / name
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "trailer":
        path.write_bytes(data[:-8] + b"NOTMAGIC")
    elif damage == "empty":
        path.write_bytes(b"")
    else:   # every array offset pointed past the data
        import json
        length = int.from_bytes(data[-16:-8], "little")
        index = json.loads(data[-16 - length:-16])
        for entry in index["matrices"].values():
            for part in entry["parts"]:
                for spec in part["arrays"].values():
                    spec[0] += 1 << 40
        head = json.dumps(index).encode()
        path.write_bytes(data[:-16 - length] + head + len(head).to_bytes(8, "little") + packed.MAGIC)
    again = _load(model.path, tmp_path)
    assert "packed into" in again.weights
    assert np.array_equal(_logits(again), want)
    assert "mapped from" in _load(model.path, tmp_path).weights


def test_a_changed_model_file_gets_a_new_packed_file_and_the_old_one_goes(tiny_gguf, tmp_path):
    model = tiny_gguf("Q4_0", seed=1)
    _load(model.path, tmp_path)
    (first,) = _bins(tmp_path)
    other = tiny_gguf("Q4_0", seed=2, name="other.gguf")
    os.replace(other.path, model.path)           # the same name, other weights
    loaded = _load(model.path, tmp_path)
    assert "packed into" in loaded.weights
    assert np.array_equal(_logits(loaded), _logits(_load(model.path, None)))
    (second,) = _bins(tmp_path)
    assert second != first


def test_packed_files_of_deleted_models_are_removed_when_another_is_written(tiny_gguf, tmp_path):
    gone = tiny_gguf("Q4_0", seed=1, name="gone.gguf")
    _load(gone.path, tmp_path / "w")
    os.unlink(gone.path)
    kept = tiny_gguf("Q4_0", seed=2, name="kept.gguf")
    _load(kept.path, tmp_path / "w")
    (only,) = _bins(tmp_path / "w")
    assert only.startswith(packed.PREFIX + packed.identity(kept.path)["tag"])


def test_a_killed_writers_leftover_is_removed_by_the_next_writer(tiny_gguf, tmp_path):
    model = tiny_gguf("Q4_0")
    ident = packed.identity(model.path)
    left = tmp_path / f"{packed.PREFIX}{ident['tag']}-{ident['key']}.bin.99999.tmp"
    left.write_bytes(b"half a file")
    assert "packed into" in _load(model.path, tmp_path).weights
    assert not left.exists() and len(_bins(tmp_path)) == 1


def test_a_full_disk_while_writing_leaves_no_file_and_the_model_runs(tiny_gguf, tmp_path, monkeypatch):
    model = tiny_gguf("Q4_0")
    want = _logits(_load(model.path, None))
    calls = []

    def failing(self, p):
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, p)

    real = packed.Writer._write
    monkeypatch.setattr(packed.Writer, "_write", failing)
    loaded = _load(model.path, tmp_path)
    assert "could not be written: No space left on device" in loaded.weights
    assert np.array_equal(_logits(loaded), want)
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".bin", ".tmp"))]


def test_too_little_free_disk_or_an_unwritable_cache_holds_the_weights_privately(tiny_gguf, tmp_path, monkeypatch):
    model = tiny_gguf("Q4_0")
    blocker = tmp_path / "file"
    blocker.write_text("")
    loaded = _load(model.path, blocker / "sub")           # a path under a file: cannot be made
    assert loaded.weights.startswith("weights held by this process (weight cache unusable")
    monkeypatch.setattr(packed.shutil, "disk_usage", lambda d: type("U", (), {"free": 1 << 20})())
    loaded = _load(model.path, tmp_path / "w")
    assert "MiB free" in loaded.weights and not _bins(tmp_path / "w")


def test_float32_activations_are_not_packed(tiny_gguf, tmp_path):
    model = tiny_gguf("Q4_0")
    loaded = load_model(model.path, device="cpu", activations="float32", weight_cache=str(tmp_path))
    assert "float32 activations" in loaded.weights and not _bins(tmp_path)


def test_a_load_waits_for_the_process_writing_the_packed_file(tiny_gguf, tmp_path):
    model = tiny_gguf("Q4_0")
    want = _logits(_load(model.path, None))
    tag = packed.identity(model.path)["tag"]
    lock = open(tmp_path / f"{packed.PREFIX}{tag}.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX)                    # as another worker writing it would
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("m", _load(model.path, tmp_path)))
    t.start()
    t.join(1.0)
    assert t.is_alive()                                  # waiting on the lock
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()
    t.join(60)
    assert np.array_equal(_logits(got["m"]), want)


GGUF_BLOCK = {2: (18, 32), 3: (20, 32), 6: (22, 32), 8: (34, 32), 12: (144, 256), 14: (210, 256)}


def _random_blocks(rng, gtype, n, k):
    size, per = GGUF_BLOCK[gtype]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    scale_at = {12: (0, 2), 14: (208,)}.get(gtype, (0, 2) if gtype == 3 else (0,))
    for at in scale_at:                                   # finite half-float scales
        raw[..., at:at + 2] = np.frombuffer(np.float16(rng.uniform(-0.1, 0.1, (n, k // per))).tobytes(),
                                            np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("gtype", sorted(GGUF_BLOCK))
def test_the_tiled_blocks_rebuilt_from_the_int8_layout_are_exact(gtype):
    rng = np.random.default_rng(gtype)
    n, k = 96, 256
    m = quant.pack(quant.decode(_random_blocks(rng, gtype, n, k), gtype, (n, k)))
    ids = np.array([0, 3, 17, 63, 64, n - 1])
    want_rows, want_ref = quant.embed_rows(m, ids), quant.dequantize(m)
    for p in m.parts:
        qs = p.qs.copy()
        int8.prepare(p)
        p.drop_tiled()
        assert p.tiled is None
        assert np.array_equal(quant.embed_rows(m, ids), want_rows)      # read from qv, qs not rebuilt
        assert p.tiled is None
        assert np.array_equal(p.qs, qs) and p.qs.dtype == qs.dtype     # rebuilt on demand
    assert np.array_equal(quant.dequantize(m), want_ref)


def test_a_token_lookup_gathers_its_rows_without_copying_the_matrix():
    import tracemalloc
    rng = np.random.default_rng(1)
    n, k = 2048, 512
    m = quant.pack(quant.decode(_random_blocks(rng, 8, n, k), 8, (n, k)))
    p = m.parts[0]
    int8.prepare(p)
    p.drop_tiled()
    tracemalloc.start()
    quant.embed_rows(m, [5])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < p.qv.nbytes // 20        # a few rows' worth, not a transposed copy of qv


def test_drop_tiled_needs_the_int8_layout():
    rng = np.random.default_rng(0)
    m = quant.pack(quant.decode(_random_blocks(rng, 2, 32, 64), 2, (32, 64)))
    with pytest.raises(ValueError, match="int8 layout"):
        m.parts[0].drop_tiled()


def test_the_weight_cache_is_beside_the_models_directory_unless_set(tmp_path):
    models = tmp_path / "cache" / "models"
    assert weight_cache_dir(Config(models_dir=str(models))) == str(tmp_path / "cache" / "weights")
    assert weight_cache_dir(Config(models_dir=str(models), weight_cache="/x/y")) == "/x/y"
    assert weight_cache_dir(Config(models_dir=str(models), weight_cache="off")) == ""
    assert Config(models_dir=str(models)).engine_options().weight_cache == str(tmp_path / "cache" / "weights")
    env = Config.from_env({"TURBOSPARK_WEIGHT_CACHE": "OFF", "TURBOSPARK_MODELS": str(models)})
    assert weight_cache_dir(env) == ""


@pytest.mark.parametrize("gtype", [12, 14])
def test_k_quant_super_scales_travel_in_the_packed_file(gtype):
    """NOTE(k-scales): a Q4_K/Q6_K weight keeps its integer scales under float32 super scales; the
    packed file's arrays hold both, and the weight rebuilt from them gives the same numbers."""
    rng = np.random.default_rng(gtype)
    m = quant.pack(quant.decode(_random_blocks(rng, gtype, 64, 512), gtype, (64, 512)))
    p = m.parts[0]
    held = packed._arrays(p)
    assert {"qv", "d", "ds"} <= set(held) and ("ms" in held) == (gtype == 12)
    entry = {"kind": p.kind, "n": p.n, "k": p.k, "arrays": {name: (name,) for name in held}}
    back = packed._weight(entry, lambda name: held[name])              # as a Reader rebuilds it
    assert back.ds is held["ds"] and back.ms is held.get("ms")
    assert np.array_equal(quant.dequantize(back), quant.dequantize(p))
