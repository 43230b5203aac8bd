"""LoRA adapters on a GGUF base over HTTP: a Q8_0 llama that runs fused int8 layers, a PEFT
directory and llama.cpp's GGUF LoRA file of the same adapter in the models directory; both listed
with the base as parent (the file is no model of its own), both give the same text, and base and
adapter requests share the engine."""
import json
import threading

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("gguf")

from lora_models import ALL_TARGETS, complete, listed, lora_app, write_adapter, write_gguf_adapter, write_gguf_base  # noqa: E402

BASE = "base-Q8_0"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root, build = tmp_path_factory.mktemp("models"), tmp_path_factory.mktemp("build")
    path, held = write_gguf_base(build)                     # held: the file's values as an HF directory
    path.rename(root / f"{BASE}.gguf")
    cfg = json.loads((held / "config.json").read_text())
    write_adapter(root / "pa", held, ALL_TARGETS, r=4, seed=1, base_name=BASE)
    write_gguf_adapter(root / "ga.gguf", root / "pa", cfg)
    write_gguf_adapter(root / "huge.gguf", root / "pa", cfg, meta={"general.base_model.count": 2 ** 63})
    write_gguf_adapter(root / "named.gguf", root / "pa", cfg, meta={"general.base_model.count": 1,
                                                                     "general.base_model.0.name": f"org/{BASE}"})
    (root / "spare").mkdir()
    write_gguf_adapter(root / "spare" / "rt.gguf", root / "pa", cfg, alpha=16)
    (root / "spare" / "plain.gguf").write_bytes((root / f"{BASE}.gguf").read_bytes())   # a model, not an adapter
    return root


@pytest.fixture(scope="module")
def client(models):
    return lora_app(models, BASE, "int8")


def test_a_gguf_lora_file_is_listed_as_an_adapter_of_the_base(client):
    data = listed(client)
    assert data["ga"]["parent"] == BASE and data["pa"]["parent"] == BASE     # the file names no base: the default
    assert "parent" not in data[BASE] and "held" not in data
    assert data["named"]["parent"] == BASE                                  # its base's name's last part
    assert data["huge"]["parent"] == BASE                                   # a hostile count: read, bounded
    assert complete(client, "huge").status_int == 200


def test_the_file_and_the_directory_give_the_same_text_on_the_fused_base(client):
    base, directory, file = complete(client, BASE), complete(client, "pa"), complete(client, "ga")
    assert base.status_int == directory.status_int == file.status_int == 200
    assert file.json["model"] == "ga"
    assert file.json["choices"][0]["text"] == directory.json["choices"][0]["text"] != base.json["choices"][0]["text"]


def test_base_and_adapter_requests_at_once_each_get_their_own_text(client):
    alone = {m: complete(client, m).json["choices"][0]["text"] for m in (BASE, "ga")}
    got = {}

    def run(model):
        got[model] = complete(client, model).json["choices"][0]["text"]
    threads = [threading.Thread(target=run, args=(m,)) for m in (BASE, "ga")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


def test_a_gguf_lora_file_loads_at_run_time_and_a_model_file_does_not(client):
    r = client.post_json("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": "spare/rt.gguf"})
    assert r.status_int == 200
    used = complete(client, "rt")                                          # alpha 16: another scale
    assert used.status_int == 200 and used.json["choices"][0]["text"] != complete(client, "ga").json["choices"][0]["text"]
    client.post_json("/v1/unload_lora_adapter", {"lora_name": "rt"})
    bad = client.post_json("/v1/load_lora_adapter", {"lora_name": "plain", "lora_path": "spare/plain.gguf"},
                           expect_errors=True)
    assert bad.status_int == 400 and bad.json["error"]["param"] == "lora_path" and "not a GGUF LoRA" in bad.json["error"]["message"]
