"""Loading: configs from metadata, the weight-name table, and errors that name the problem."""
import json

import numpy as np
import pytest

from turbospark_wsgi.engine.gguf import GGUFFile, GGUFFormatError, model_config_from_gguf, read_metadata
from turbospark_wsgi.engine.loader import LoadedModel, load_model
from turbospark_wsgi.engine.safetensors_io import SafetensorsDir, SafetensorsFile, model_config_from_hf
from turbospark_wsgi.engine.weights import unpermute_rotary_rows


def test_gguf_load_reports_kind_metadata_and_backend(tiny_gguf):
    tiny = tiny_gguf(tied=True)
    loaded = load_model(tiny.path, device="cpu")
    assert isinstance(loaded, LoadedModel)
    assert (loaded.kind, loaded.path, loaded.backend) == ("gguf", str(tiny.path), "numpy")
    assert loaded.metadata == read_metadata(tiny.path)
    cfg = loaded.config
    assert (cfg.arch, cfg.n_layer, cfg.dim, cfg.n_head, cfg.n_kv_head, cfg.ffn_dim) == ("llama", 2, 64, 4, 2, 128)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.head_dim, cfg.rope_dim) == (tiny.config["vocab_size"], 256, 16, 16)
    assert cfg.tied_embeddings and cfg.rope_scaling == {}


def test_hf_dir_metadata_holds_the_json_files(tiny_hf_dir):
    tiny = tiny_hf_dir()
    loaded = load_model(tiny.path)
    assert loaded.kind == "hf"
    assert loaded.metadata["config"] == tiny.config
    assert loaded.metadata["generation_config"]["eos_token_id"] == 2
    assert loaded.metadata["tokenizer_config"]["eos_token"] == "<|im_end|>"
    (tiny.path / "generation_config.json").unlink()
    assert load_model(tiny.path).metadata["generation_config"] is None


def test_default_model_config(default_gguf):
    cfg = model_config_from_gguf(read_metadata(default_gguf))
    assert (cfg.n_layer, cfg.dim, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.ffn_dim) == (30, 576, 9, 3, 64, 1536)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.kv_mul) == (49152, 100000.0, 3)
    assert cfg.norm_eps == pytest.approx(1e-5)
    tensors = GGUFFile(default_gguf).tensors
    assert "output.weight" not in tensors and tensors["token_embd.weight"].shape == (49152, 576)


def test_hf_config_rope_fields():
    base = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
    cfg = model_config_from_hf(dict(base, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 7.0}))
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.n_kv_head, cfg.tied_embeddings) == (7.0, {"type": "linear", "factor": 2.0}, 4, False)
    cfg = model_config_from_hf(dict(base, rope_theta=9.0, rope_scaling={"type": "linear", "factor": 3.0}, tie_word_embeddings=True))
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.tied_embeddings) == (9.0, {"type": "linear", "factor": 3.0}, True)
    assert model_config_from_hf(dict(base, rope_parameters={"rope_type": "default", "rope_theta": 5.0})).rope_scaling == {}


def test_unpermute_rotary_rows_follows_the_documented_rule(tiny_gguf):
    # GGUF row h*D + 2i + j holds HF row h*D + j*D/2 + i
    n_heads, d = 3, 8
    gguf_rows = np.arange(n_heads * d, dtype=np.float32)[:, None] * np.ones((1, 5), np.float32)
    hf = unpermute_rotary_rows(gguf_rows, n_heads)
    for h in range(n_heads):
        for i in range(d // 2):
            for j in range(2):
                assert hf[h * d + j * d // 2 + i, 0] == h * d + 2 * i + j


def test_safetensors_dtypes_and_shards(tiny_hf_dir):
    tiny = tiny_hf_dir(dtype="F16", shards=2)
    source = SafetensorsDir(tiny.path)
    assert set(source.names) == set(tiny.state)
    for name, value in tiny.state.items():
        got = source.tensor(name)
        assert got.dtype == np.float32 and np.array_equal(got, value)


# ---------------------------------------------------------------- errors that name the problem

def test_unknown_gguf_architecture_is_named(tiny_gguf):
    tiny = tiny_gguf(arch="mamba")
    with pytest.raises(ValueError, match="unsupported model architecture 'mamba'"):
        load_model(tiny.path)


def test_unknown_hf_architecture_is_named(tiny_hf_dir):
    tiny = tiny_hf_dir()
    (tiny.path / "config.json").write_text(json.dumps(dict(tiny.config, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(tiny.path)


def test_unsupported_tensor_type_is_named(tiny_gguf):
    from gguf import GGMLQuantizationType
    block = np.zeros((128, 64 // 32 * 18), dtype=np.uint8)             # IQ4_NL: 32 values in 18 bytes
    tiny = tiny_gguf(raw={"blk.1.ffn_gate.weight": (block, GGMLQuantizationType.IQ4_NL)})
    with pytest.raises(ValueError, match="'blk.1.ffn_gate.weight'.*IQ4_NL"):
        load_model(tiny.path)


def test_unsupported_safetensors_dtype_is_named(tmp_path):
    from safetensors.numpy import save_file
    save_file({"model.norm.weight": np.zeros(4, np.int32)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="'model.norm.weight'.*I32"):
        SafetensorsFile(tmp_path / "x.safetensors").tensor("model.norm.weight")


def test_missing_gguf_tensor_is_named(tiny_gguf):
    tiny = tiny_gguf(drop={"blk.1.ffn_up.weight"})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight"):
        load_model(tiny.path)


def test_missing_head_of_untied_model_is_named(tiny_hf_dir):
    tiny = tiny_hf_dir()
    state = {k: v for k, v in tiny.state.items() if k != "lm_head.weight"}
    from safetensors.numpy import save_file
    save_file(state, str(tiny.path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_model(tiny.path)


@pytest.mark.parametrize("keep", [0.05, 0.6, 0.999])
def test_truncated_gguf_is_reported(tiny_gguf, tmp_path, keep):
    data = tiny_gguf().path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(GGUFFormatError, match="truncated GGUF file"):
        load_model(cut)


def test_truncated_safetensors_is_reported(tiny_hf_dir):
    tiny = tiny_hf_dir()
    f = tiny.path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated safetensors"):
        load_model(tiny.path)


def test_missing_path_and_bad_magic(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope.gguf")
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GGUFFormatError, match="bad magic"):
        load_model(tmp_path / "x.gguf")


def test_weight_storage_says_which_types_stay_quantized(tmp_path, monkeypatch):
    """`turbospark models`' weights column: block kernels for Q5_0/Q8_0/..., float32 for the rest."""
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as GT, quants
    from turbospark_wsgi.engine.kernels import cpu as kernels_cpu
    from turbospark_wsgi.engine.loader import weight_storage
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for name, qtype in (("a", GT.Q5_0), ("b", GT.Q5_0), ("c", GT.Q8_0), ("d", GT.Q5_1)):
        raw = quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), qtype)
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.add_tensor("norm", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = str(tmp_path / "m.gguf")
    monkeypatch.setattr(kernels_cpu, "AVAILABLE", True)
    assert weight_storage(path) == "kept quantized: Q5_0 x2, Q8_0 x1; dequantized to float32: Q5_1 x1; float32: F32 x1"
    monkeypatch.setattr(kernels_cpu, "AVAILABLE", False)
    assert weight_storage(path) == "dequantized to float32: Q5_0 x2, Q5_1 x1, Q8_0 x1; float32: F32 x1"
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 8)
    assert weight_storage(str(tmp_path / "bad.gguf")) == "" == weight_storage(str(tmp_path))


def test_a_matrix_with_a_part_without_block_kernel_is_read_once_as_float32(tiny_gguf, monkeypatch):
    """A Q8_0 file whose layer 0 V and layer 1 up projections are F16 (no block kernel): layer 0's
    q | k | v and layer 1's gate | up are float32, exactly as the float32 loader makes them, the
    rest stays in block form, and no tensor is read from the file twice."""
    from gguf import GGMLQuantizationType as GT
    from turbospark_wsgi.engine.kernels import cpu as kernels_cpu
    if not kernels_cpu.AVAILABLE:
        pytest.skip("block form needs numba")
    rng = np.random.default_rng(1)
    f16 = {"blk.0.attn_v.weight": (32, 64), "blk.1.ffn_up.weight": (128, 64)}
    tiny = tiny_gguf("Q8_0", raw={name: ((rng.standard_normal(shape) / 8).astype(np.float16), GT.F16)
                                  for name, shape in f16.items()})
    reads, real = [], GGUFFile.raw
    monkeypatch.setattr(GGUFFile, "raw", lambda self, name: (reads.append(name), real(self, name))[1])
    kept = load_model(tiny.path, weights="quant").model.w.layers
    assert sorted(reads) == sorted(set(reads))
    monkeypatch.undo()
    fp32 = load_model(tiny.path, weights="fp32").model.w.layers
    assert isinstance(kept[0].wqkv, np.ndarray) and np.array_equal(kept[0].wqkv, fp32[0].wqkv)
    assert isinstance(kept[1].w_gate_up, np.ndarray) and np.array_equal(kept[1].w_gate_up, fp32[1].w_gate_up)
    assert all(isinstance(w, kernels_cpu.QLinear) for w in (kept[0].wo, kept[0].w_gate_up, kept[1].wqkv))
