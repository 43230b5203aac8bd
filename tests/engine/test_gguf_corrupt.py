"""Corrupt model files: every malformed header is a clear load error, found without reading or
allocating past the file's size, quickly, and with no file path in the message.

A valid tiny GGUF (with `general.alignment` and a nested array added) is written once per test, then
single fields are overwritten at offsets found by the small layout walker below, which knows the
GGUF format independently of the code under test."""
import json
import random
import struct
import time
import tracemalloc

import pytest

from turbospark_wsgi.engine import load_engine

ALLOWED = (ValueError, OSError, ImportError, KeyError)   # what the registry turns into model_load_failed
HUGE_STRING, HUGE_COUNT = 2 ** 63, 2 ** 62
GIB = 2 ** 30
MAX_EXTRA_BYTES = 8 * 2 ** 20    # a load error may allocate at most this much beyond the file size
MAX_SECONDS = 5.0


# ------------------------------------------------------------------- the tiny model and its layout

@pytest.fixture
def tiny_bytes(tiny_gguf, monkeypatch):
    """The bytes of a valid tiny GGUF that also carries general.alignment = 32 and a nested array."""
    import gguf
    add_name = gguf.GGUFWriter.add_name

    def add_name_and_more(self, name):
        add_name(self, name)
        self.add_custom_alignment(32)
        self.add_array("tiny.nested", [[1, 2], [3]])

    monkeypatch.setattr(gguf.GGUFWriter, "add_name", add_name_and_more)
    return tiny_gguf().path.read_bytes()


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def layout(data):
    """Offsets of every size, count and type field: {"kv": {key: {...}}, "tensors": {name: {...}},
    "tensor_table_end": offset}."""
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def u(fmt):
        nonlocal pos
        value = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def skip_value(vtype, fields):
        nonlocal pos
        if vtype in _SCALAR_SIZES:
            fields.setdefault("value_at", pos)
            pos += _SCALAR_SIZES[vtype]
        elif vtype == 8:
            fields.setdefault("len_at", pos)
            n = u("<Q")
            pos += n
        else:
            fields.setdefault("item_type_at", pos)
            item = u("<I")
            fields.setdefault("count_at", pos)
            n = u("<Q")
            inner = {}
            for _ in range(n):
                skip_value(item, inner)
            if inner:
                fields.setdefault("first_item", inner)

    kvs = {}
    for _ in range(n_kv):
        fields = {"key_len_at": pos}
        n = u("<Q")
        key, pos = data[pos:pos + n].decode(), pos + n
        fields["type_at"] = pos
        skip_value(u("<I"), fields)
        kvs[key] = fields
    tensors = {}
    for _ in range(n_tensors):
        fields = {"name_len_at": pos}
        n = u("<Q")
        name, pos = data[pos:pos + n].decode(), pos + n
        fields["n_dims_at"] = pos
        n_dims = u("<I")
        fields["dims_at"] = [pos + 8 * i for i in range(n_dims)]
        pos += 8 * len(fields["dims_at"])
        fields["type_at"], fields["offset_at"] = pos, pos + 4
        pos += 12
        tensors[name] = fields
    return {"kv": kvs, "tensors": tensors, "tensor_table_end": pos}


def put(data, at, fmt, *values):
    out = bytearray(data)
    struct.pack_into(fmt, out, at, *values)
    return bytes(out)


def assert_load_error(path, data, match=None):
    """Loading `data` raises an allowed error quickly, within a bounded allocation, without the path."""
    path.write_bytes(data)
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(ALLOWED) as caught:
            load_engine(path, device="cpu")
        elapsed = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert str(path.parent) not in message and path.name not in message, message
    assert elapsed < MAX_SECONDS, f"{elapsed:.1f} s to fail: {message}"
    assert peak < len(data) + MAX_EXTRA_BYTES, f"peak {peak} bytes for a {len(data)} byte file: {message}"
    if match:
        assert caught.match(match), message
    return caught.value


# ----------------------------------------------------------------------- header fields, one by one

def test_the_untouched_tiny_model_loads(tiny_bytes, tmp_path):
    (tmp_path / "ok.gguf").write_bytes(tiny_bytes)
    assert load_engine(tmp_path / "ok.gguf", device="cpu").config.n_layer == 2


def _kv(name, field, fmt, value):
    return lambda lay: (lay["kv"][name][field], fmt, value)


def _item(name, field, fmt, value):
    return lambda lay: (lay["kv"][name]["first_item"][field], fmt, value)


def _tensor(name, field, fmt, value, index=None):
    return lambda lay: ((lay["tensors"][name][field] if index is None else lay["tensors"][name][field][index]),
                        fmt, value)


HEADER_CASES = {
    "tensor count 2^62": (lambda lay: (8, "<Q", HUGE_COUNT), r"tensor count 4611686018427387904"),
    "kv count 2^62": (lambda lay: (16, "<Q", HUGE_COUNT), r"key/value count 4611686018427387904"),
    "key length 2^63": (_kv("general.name", "key_len_at", "<Q", HUGE_STRING), r"string length 9223372036854775808"),
    "key length 1 GiB": (_kv("general.name", "key_len_at", "<Q", GIB), r"string length 1073741824"),
    "unknown value type": (_kv("general.name", "type_at", "<I", 99), r"unknown .*value type 99"),
    "string length 2^63": (_kv("general.name", "len_at", "<Q", HUGE_STRING), r"string length 9223372036854775808"),
    "string length 1 GiB": (_kv("general.architecture", "len_at", "<Q", GIB), r"string length 1073741824"),
    "string array count 2^62": (_kv("tokenizer.ggml.tokens", "count_at", "<Q", HUGE_COUNT),
                                r"array count 4611686018427387904"),
    "string array count past the file": (_kv("tokenizer.ggml.tokens", "count_at", "<Q", 10 ** 6), r"array count 1000000"),
    "scalar array count 2^62": (_kv("tokenizer.ggml.token_type", "count_at", "<Q", HUGE_COUNT),
                                r"array count 4611686018427387904"),
    "scalar array count 2^26": (_kv("tokenizer.ggml.token_type", "count_at", "<Q", 2 ** 26), r"array count 67108864"),
    "unknown array element type": (_kv("tokenizer.ggml.tokens", "item_type_at", "<I", 77), r"unknown .*type 77"),
    "string in an array 2^63": (_item("tokenizer.ggml.tokens", "len_at", "<Q", HUGE_STRING),
                                r"string length 9223372036854775808"),
    "nested array count 2^62": (_item("tiny.nested", "count_at", "<Q", HUGE_COUNT), r"array count 4611686018427387904"),
    "nested array element type": (_item("tiny.nested", "item_type_at", "<I", 4000), r"unknown .*type 4000"),
    "alignment 0": (_kv("general.alignment", "value_at", "<I", 0), r"alignment 0"),
    "alignment not a power of two": (_kv("general.alignment", "value_at", "<I", 48), r"alignment 48"),
    "alignment absurd": (_kv("general.alignment", "value_at", "<I", 2 ** 31), r"alignment 2147483648"),
    "alignment of the wrong type": (_kv("general.alignment", "type_at", "<I", 6), r"general.alignment"),
    "tensor name length 2^63": (_tensor("output_norm.weight", "name_len_at", "<Q", HUGE_STRING),
                                r"string length 9223372036854775808"),
    "tensor n_dims 2^31": (_tensor("output_norm.weight", "n_dims_at", "<I", 2 ** 31), r"2147483648 dimensions"),
    "tensor n_dims 9": (_tensor("output_norm.weight", "n_dims_at", "<I", 9), r"9 dimensions"),
    "tensor dims overflow int64": (_tensor("blk.0.ffn_up.weight", "dims_at", "<Q", 2 ** 62, 1),
                                   r"blk\.0\.ffn_up\.weight"),
    "tensor dims past the file": (_tensor("blk.0.ffn_up.weight", "dims_at", "<Q", 10 ** 6, 1),
                                  r"blk\.0\.ffn_up\.weight"),
    "tensor unknown type id": (_tensor("blk.0.ffn_up.weight", "type_at", "<I", 1000), r"type.* 1000"),
    "tensor offset 2^63": (_tensor("blk.0.ffn_up.weight", "offset_at", "<Q", HUGE_STRING), r"blk\.0\.ffn_up\.weight"),
    "tensor offset not aligned": (_tensor("blk.0.ffn_up.weight", "offset_at", "<Q", 4), r"blk\.0\.ffn_up\.weight"),
}


@pytest.mark.parametrize("case", HEADER_CASES, ids=list(HEADER_CASES))
def test_a_corrupt_header_field_is_a_clear_load_error(tiny_bytes, tmp_path, case):
    where, match = HEADER_CASES[case]
    at, fmt, value = where(layout(tiny_bytes))
    error = assert_load_error(tmp_path / "bad.gguf", put(tiny_bytes, at, fmt, value), match)
    assert isinstance(error, ValueError)
    assert "corrupt GGUF" in str(error) or "truncated GGUF file" in str(error), str(error)


def test_a_tensor_offset_past_the_data_is_named(tiny_bytes, tmp_path):
    lay = layout(tiny_bytes)
    at = lay["tensors"]["blk.0.ffn_up.weight"]["offset_at"]
    assert_load_error(tmp_path / "bad.gguf", put(tiny_bytes, at, "<Q", len(tiny_bytes) // 32 * 32),
                      r"blk\.0\.ffn_up\.weight")


def test_a_duplicate_tensor_name_is_an_error(tiny_bytes, tmp_path):
    lay = layout(tiny_bytes)
    a, b = lay["tensors"]["blk.0.ffn_up.weight"], lay["tensors"]["blk.1.ffn_up.weight"]
    data = bytearray(tiny_bytes)
    data[b["name_len_at"] + 8:b["name_len_at"] + 8 + len("blk.0")] = b"blk.0"
    assert a["name_len_at"] != b["name_len_at"]
    assert_load_error(tmp_path / "bad.gguf", bytes(data), r"duplicate tensor 'blk\.0\.ffn_up\.weight'")


def test_deeply_nested_arrays_are_refused(tmp_path):
    depth = 100_000
    key = b"x.deep"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    body += struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0)
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body
    assert_load_error(tmp_path / "deep.gguf", data, r"nested .*arrays")


@pytest.mark.parametrize("key,value_type,raw", [
    ("llama.block_count", 6, struct.pack("<f", 2.0)),             # float where a count belongs
    ("llama.attention.head_count", 4, struct.pack("<I", 0)),     # zero heads
    ("llama.attention.head_count_kv", 4, struct.pack("<I", 3)),  # 4 heads do not group into 3
    ("llama.embedding_length", 4, struct.pack("<I", 0)),
])
def test_metadata_values_that_cannot_describe_a_model_are_named(tiny_bytes, tmp_path, key, value_type, raw):
    lay = layout(tiny_bytes)["kv"][key]
    data = put(tiny_bytes, lay["type_at"], "<I", value_type)
    data = data[:lay["value_at"]] + raw + data[lay["value_at"] + len(raw):]
    assert_load_error(tmp_path / "bad.gguf", data, key.split(".", 1)[1].replace(".", r"\."))


def test_a_large_layer_count_fails_fast_at_the_first_missing_layer(tiny_bytes, tmp_path):
    at = layout(tiny_bytes)["kv"]["llama.block_count"]["value_at"]
    assert_load_error(tmp_path / "bad.gguf", put(tiny_bytes, at, "<I", 4096), r"lacks tensor 'blk\.2\.")


def test_a_layer_count_past_any_model_is_refused_before_a_list_is_built_per_layer(tiny_bytes, tmp_path):
    at = layout(tiny_bytes)["kv"]["llama.block_count"]["value_at"]
    assert_load_error(tmp_path / "bad.gguf", put(tiny_bytes, at, "<I", 2 ** 31),
                      r"block_count' must be an integer from 1 to 4096")


def test_a_config_that_disagrees_with_the_tensors_is_named(tiny_hf_dir):
    path = tiny_hf_dir().path
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, intermediate_size=10 ** 9)))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(128, 64\)"):
        load_engine(path, device="cpu")


def test_metadata_values_of_the_wrong_kind_are_named(tiny_bytes, tmp_path):
    lay = layout(tiny_bytes)["kv"]["general.architecture"]
    assert tiny_bytes[lay["len_at"]:lay["len_at"] + 13] == struct.pack("<Q", 5) + b"llama"
    # the same 17 bytes as an array of one uint8: well formed, but no architecture name
    data = put(tiny_bytes, lay["type_at"], "<IIQB", 9, 0, 1, 7)
    assert_load_error(tmp_path / "bad.gguf", data, r"general\.architecture")


def test_a_merge_of_unknown_tokens_is_a_load_error(tiny_bytes, tmp_path):
    at = layout(tiny_bytes)["kv"]["tokenizer.ggml.merges"]["first_item"]["len_at"]
    first = "Ġ t".encode()
    assert tiny_bytes[at + 8:at + 8 + len(first)] == first
    data = tiny_bytes[:at + 8] + "Ġ q".encode() + tiny_bytes[at + 8 + len(first):]   # "Ġq" is no token
    assert_load_error(tmp_path / "bad.gguf", data, r"tokenizer cannot be built")


# ------------------------------------------------------------------------ truncation and byte flips

@pytest.mark.parametrize("sixteenths", range(16))
def test_a_file_truncated_anywhere_is_a_load_error(tiny_bytes, tmp_path, sixteenths):
    assert_load_error(tmp_path / "cut.gguf", tiny_bytes[:len(tiny_bytes) * sixteenths // 16])


@pytest.mark.parametrize("seed", range(8))
def test_random_byte_flips_in_the_header_load_or_fail_cleanly(tiny_bytes, tmp_path, seed):
    rng = random.Random(seed)
    end = layout(tiny_bytes)["tensor_table_end"]
    path = tmp_path / "flipped.gguf"
    for _ in range(40):
        data = bytearray(tiny_bytes)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(end)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        try:
            load_engine(path, device="cpu")
        except ALLOWED as e:
            assert str(tmp_path) not in str(e) and path.name not in str(e), str(e)


# --------------------------------------------------------------------------------- safetensors

@pytest.fixture
def hf_dir(tiny_hf_dir):
    return tiny_hf_dir().path


def _rewrite_header(path, edit):
    data = path.read_bytes()
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    header = edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _first(header):
    return next(k for k in header if k != "__metadata__")


SAFETENSORS_CASES = {
    "header length 2^63": (lambda p: p.write_bytes(struct.pack("<Q", HUGE_STRING) + p.read_bytes()[8:]),
                           r"header length 9223372036854775808"),
    "header length 1 GiB": (lambda p: p.write_bytes(struct.pack("<Q", GIB) + p.read_bytes()[8:]),
                            r"header length 1073741824"),
    "header not an object": (lambda p: _rewrite_header(p, lambda h: [1, 2]), r"not a JSON object"),
    "entry not an object": (lambda p: _rewrite_header(p, lambda h: dict(h, **{_first(h): 7})), r"tensor '"),
    "offsets past the end": (lambda p: _rewrite_header(p, lambda h: dict(h, **{_first(h): dict(
        h[_first(h)], data_offsets=[0, 2 ** 40])})), r"past the end"),
    "offsets reversed": (lambda p: _rewrite_header(p, lambda h: dict(h, **{_first(h): dict(
        h[_first(h)], data_offsets=[8, 4])})), r"data_offsets"),
    "unknown dtype": (lambda p: _rewrite_header(p, lambda h: dict(h, **{_first(h): dict(
        h[_first(h)], dtype="X99")})), r"dtype 'X99'"),
    "shape and offsets disagree": (lambda p: _rewrite_header(p, lambda h: dict(h, **{_first(h): dict(
        h[_first(h)], shape=[3, 3])})), r"shape"),
    "negative shape": (lambda p: _rewrite_header(p, lambda h: dict(h, **{_first(h): dict(
        h[_first(h)], shape=[-1])})), r"shape"),
}


@pytest.mark.parametrize("case", SAFETENSORS_CASES, ids=list(SAFETENSORS_CASES))
def test_a_corrupt_safetensors_header_is_a_clear_load_error(hf_dir, case):
    corrupt, match = SAFETENSORS_CASES[case]
    path = hf_dir / "model.safetensors"
    corrupt(path)
    data = path.read_bytes()
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=match) as caught:
            load_engine(hf_dir, device="cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(hf_dir) not in str(caught.value)
    assert peak < len(data) + MAX_EXTRA_BYTES


def test_a_shard_name_outside_the_directory_is_refused(tiny_hf_dir):
    path = tiny_hf_dir(shards=2).path
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="elsewhere") as caught:
        load_engine(path, device="cpu")
    assert str(path) not in str(caught.value)


@pytest.mark.parametrize("content", ["[1, 2]", '{"weight_map": [1]}', "{"])
def test_a_malformed_index_is_a_clear_load_error(tiny_hf_dir, content):
    path = tiny_hf_dir(shards=2).path
    (path / "model.safetensors.index.json").write_text(content)
    with pytest.raises(ValueError, match="model.safetensors.index.json") as caught:
        load_engine(path, device="cpu")
    assert str(path) not in str(caught.value)


@pytest.mark.parametrize("content", ["[1, 2]", '"x"', "{", '{"architectures": "LlamaForCausalLM"}'])
def test_a_malformed_config_json_is_a_clear_load_error(tiny_hf_dir, content):
    path = tiny_hf_dir().path
    (path / "config.json").write_text(content)
    with pytest.raises(ValueError, match="config.json") as caught:
        load_engine(path, device="cpu")
    assert str(path) not in str(caught.value)


@pytest.mark.parametrize("content", [None, "[1]", "{"])
def test_a_missing_or_malformed_tokenizer_json_is_a_load_error(tiny_hf_dir, content):
    path = tiny_hf_dir().path
    if content is None:
        (path / "tokenizer.json").unlink()
    else:
        (path / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError, match="tokenizer.json") as caught:
        load_engine(path, device="cpu")
    assert str(path) not in str(caught.value)


# ------------------------------------------------------------------------- paths stay private

def test_missing_files_do_not_reveal_the_path(tmp_path, tiny_hf_dir):
    with pytest.raises(FileNotFoundError) as caught:
        load_engine(tmp_path / "secret" / "nope.gguf", device="cpu")
    assert str(tmp_path) not in str(caught.value)
    path = tiny_hf_dir().path
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json") as caught:
        load_engine(path, device="cpu")
    assert str(path) not in str(caught.value)


def test_an_unreadable_file_does_not_reveal_the_path(tiny_bytes, tmp_path, monkeypatch):
    path = tmp_path / "locked.gguf"
    path.write_bytes(tiny_bytes)

    def denied(file, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr("builtins.open", denied)   # as for a file of mode 000 (root reads those anyway)
    with pytest.raises(OSError, match="Permission denied") as caught:
        load_engine(path, device="cpu")
    assert str(tmp_path) not in str(caught.value)
