"""tools/make_bench_model.py and tools/read_bandwidth.py on tiny shapes: the presets, the file the
streaming writer makes, the Q4_K_M step, the bytes a token reads, and the C bandwidth reader."""
import hashlib
import os
import stat
import sys
from pathlib import Path

import gguf
import pytest

from turbospark_wsgi.engine.gguf import GGUFFile, ggml_type_name, model_config_from_gguf

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import make_bench_model as make  # noqa: E402
import read_bandwidth  # noqa: E402

VOCAB = 96
TINY = ["--dim", "64", "--layers", "2", "--ffn", "128", "--heads", "4", "--kv-heads", "2"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A GGUF holding only a VOCAB-token tokenizer, for --tokenizer-from."""
    path = tmp_path_factory.mktemp("tok") / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([1] * VOCAB)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def tiny(tmp_path, tokenizer, *flags):
    out = str(tmp_path / "m.gguf")
    make.main([out, "--tokenizer-from", tokenizer, *TINY, *flags])
    return out


def test_presets_are_the_llama_shapes_and_flags_override_them():
    one, three, eight = (make.parse_args(["o.gguf", "--preset", p]) for p in ("1b", "3b", "8b"))
    assert (one.dim, one.layers, one.ffn, one.heads, one.kv_heads, one.tied_embeddings) == (2048, 16, 8192, 32, 8, True)
    assert (three.dim, three.layers, three.ffn, three.heads, three.kv_heads, three.tied_embeddings) == (
        3072, 28, 8192, 24, 8, True)
    assert (eight.dim, eight.layers, eight.ffn, eight.heads, eight.kv_heads, eight.tied_embeddings) == (
        4096, 32, 14336, 32, 8, False)
    assert vars(make.parse_args(["o.gguf"])) | {"preset": "1b"} == vars(one)          # no preset: 1b's shape
    mixed = make.parse_args(["o.gguf", "--preset", "8b", "--layers", "2", "--tied-embeddings"])
    assert (mixed.dim, mixed.layers, mixed.tied_embeddings) == (4096, 2, True)
    with pytest.raises(SystemExit):
        make.parse_args(["o.gguf", "--dim", "100", "--heads", "3"])


def test_a_tiny_untied_model_has_the_expected_tensors(tmp_path, tokenizer):
    f = GGUFFile(tiny(tmp_path, tokenizer, "--preset", "8b"))
    cfg = model_config_from_gguf(f.metadata)
    assert (cfg.n_layer, cfg.dim, cfg.n_head, cfg.n_kv_head, cfg.vocab_size) == (2, 64, 4, 2, VOCAB)
    table = {n: (t.shape, ggml_type_name(t.ggml_type)) for n, t in f.tensors.items()}
    assert table["token_embd.weight"] == table["output.weight"] == ((VOCAB, 64), "Q8_0")
    assert table["output_norm.weight"] == table["blk.1.ffn_norm.weight"] == ((64,), "F32")
    assert table["blk.0.attn_k.weight"] == ((32, 64), "Q4_0")                         # 2 KV heads of 16
    assert table["blk.1.ffn_down.weight"] == ((64, 128), "Q4_0")
    assert len(table) == 3 + 2 * 9
    w = f.tensor("blk.1.ffn_down.weight")
    assert abs(w.std() - 0.02) < 0.003 and (f.tensor("blk.0.attn_norm.weight") == 1).all()
    assert gguf.GGUFReader(f.path).fields["tokenizer.ggml.tokens"].contents()[-1] == f"t{VOCAB - 1}"


def test_the_file_is_the_same_whatever_the_chunk_of_rows(tmp_path, tokenizer, monkeypatch):
    """Rows are drawn and quantized a chunk at a time: the chunk size changes nothing in the file."""
    whole = Path(tiny(tmp_path, tokenizer, "--type", "Q8_0")).read_bytes()
    monkeypatch.setattr(make, "CHUNK", 3 * 64)                  # 3 rows of a 64-wide matrix, 1 of ffn_down
    chunked = Path(tiny(tmp_path, tokenizer, "--type", "Q8_0")).read_bytes()
    assert hashlib.sha256(whole).digest() == hashlib.sha256(chunked).digest()
    types = {ggml_type_name(t.ggml_type) for t in GGUFFile(tmp_path / "m.gguf").tensors.values()}
    assert types == {"Q8_0", "F32"} and "output.weight" not in GGUFFile(tmp_path / "m.gguf").tensors


def test_q4_k_m_requantizes_a_q8_0_file_with_llama_quantize(tmp_path, tokenizer):
    quantize = tmp_path / "llama-quantize"
    quantize.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\ncp "$2" "$3"\n')
    quantize.chmod(quantize.stat().st_mode | stat.S_IXUSR)
    out = tiny(tmp_path, tokenizer, "--type", "Q4_K_M", "--llama-quantize", str(quantize))
    source = f"{out}.q8_0.tmp"
    assert (tmp_path / "args").read_text().split() == ["--allow-requantize", source, out, "Q4_K_M"]
    assert not os.path.exists(source)                                               # removed after
    assert ggml_type_name(GGUFFile(out).tensors["blk.0.attn_q.weight"].ggml_type) == "Q8_0"   # the fake copies


def test_q4_k_m_without_llama_quantize_names_the_build_script(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(make, "llama_binary", lambda name: None)
    with pytest.raises(SystemExit, match="tools/build_llama_server.sh"):
        tiny(tmp_path, tokenizer, "--type", "Q4_K_M")
    assert not list(tmp_path.iterdir())                         # nothing written before the check


def test_bytes_per_token_counts_a_tied_embedding_once_and_a_separate_one_by_its_row(tmp_path, tokenizer):
    def sizes(path):
        return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}

    tied = tiny(tmp_path, tokenizer)
    assert read_bandwidth.bytes_per_token(tied) == sum(sizes(tied).values())
    untied = tiny(tmp_path, tokenizer, "--no-tied-embeddings")
    embd = sizes(untied)["token_embd.weight"]
    row = embd // VOCAB                                                             # 64 / 32 blocks x 34 bytes
    assert row == 68 and read_bandwidth.bytes_per_token(untied) == sum(sizes(untied).values()) - embd + row


def test_the_bandwidth_reader_compiles_and_reads(tmp_path):
    from turbospark_wsgi.engine.kernels.native import compiler
    if compiler() is None:
        pytest.skip("no C compiler (cc, gcc or clang) on PATH")
    rates = read_bandwidth.read_bandwidth((1, 2), mib=4, passes=2, directory=tmp_path)
    assert set(rates) == {1, 2} and all(gb > 0 for gb in rates.values())
    assert len(list(tmp_path.iterdir())) == 1                   # built once, kept for the next call
