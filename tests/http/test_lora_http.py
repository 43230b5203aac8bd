"""LoRA adapters over HTTP on a real engine (a tiny random Hugging Face llama): /v1/models lists
them with their parent, a request selects one by `model`, vLLM's load/unload routes, and the
refusals, each a 4xx in the route's envelope that leaves a neighbouring request as it was."""
import json
import threading

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from lora_models import ALL_TARGETS, complete, listed, lora_app, write_adapter, write_base  # noqa: E402

BASE = "tiny-llama"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base = write_base(root / BASE)
    write_adapter(root / "a1", base, ALL_TARGETS, r=4, seed=1)                 # discovered
    write_adapter(root / "spare" / "rt", base, ["q_proj", "v_proj"], r=8, seed=2)     # loaded at run time
    wide = write_base(root / "staging" / "wide", hidden_size=32, intermediate_size=64)
    write_adapter(root / "wide-lora", wide, ["q_proj"], base_name=BASE)         # says tiny-llama, fits another
    missing = write_adapter(root / "spare" / "missing", base, ["q_proj"])
    (missing / "adapter_model.safetensors").unlink()
    from safetensors.numpy import load_file, save_file
    import numpy as np
    skew = write_adapter(root / "spare" / "skew", base, ["q_proj"], r=4)
    tensors = load_file(str(skew / "adapter_model.safetensors"))
    name = next(k for k in tensors if "lora_B" in k)
    tensors[name] = np.ones((tensors[name].shape[0], 3), np.float32)
    save_file(tensors, str(skew / "adapter_model.safetensors"))
    (tmp_path_factory.mktemp("outside") / "adapter_config.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def client(models):
    return lora_app(models, BASE, "float32")


def test_models_lists_adapters_with_their_parent(client):
    data = listed(client)
    assert data["a1"]["parent"] == BASE and data["a1"]["capabilities"] == ["generation"]
    assert data["wide-lora"]["parent"] == BASE
    assert "parent" not in data[BASE]
    assert client.get("/v1/models/a1").json["parent"] == BASE


def test_a_request_selects_an_adapter_by_model(client):
    base, adapted = complete(client, BASE), complete(client, "a1")
    assert base.status_int == adapted.status_int == 200
    assert adapted.json["model"] == "a1"
    assert adapted.json["choices"][0]["text"] != base.json["choices"][0]["text"]
    assert complete(client, "a1").json["choices"][0]["text"] == adapted.json["choices"][0]["text"]
    chat = client.post_json("/v1/chat/completions", {"model": "a1", "max_tokens": 8, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_int == 200 and chat.json["model"] == "a1"
    streamed = client.post_json("/v1/completions", {"model": "a1", "prompt": "Once upon a time", "max_tokens": 12,
                                                    "temperature": 0, "stream": True})
    chunks = [json.loads(f[6:]) for f in streamed.text.split("\n\n") if f.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == adapted.json["choices"][0]["text"]


def test_load_and_unload_at_run_time(client):
    before = complete(client, BASE).json["choices"][0]["text"]
    r = client.post_json("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": "spare/rt"})
    assert r.status_int == 200 and r.content_type == "text/plain" and "'rt' added" in r.text
    assert {m["id"]: m.get("parent") for m in client.get("/v1/models").json["data"]}["rt"] == BASE
    used = complete(client, "rt")
    assert used.status_int == 200 and used.json["choices"][0]["text"] != before
    again = client.post_json("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": "spare/rt"}, expect_errors=True)
    assert again.status_int == 400 and again.json["error"]["code"] == "lora_adapter_exists"
    r = client.post_json("/v1/unload_lora_adapter", {"lora_name": "rt"})
    assert r.status_int == 200 and "'rt' removed" in r.text
    gone = complete(client, "rt")
    assert gone.status_int == 404 and gone.json["error"]["code"] == "model_not_found"
    missing = client.post_json("/v1/unload_lora_adapter", {"lora_name": "rt"}, expect_errors=True)
    assert missing.status_int == 404 and missing.json["error"]["param"] == "lora_name"
    installed = client.post_json("/v1/unload_lora_adapter", {"lora_name": "a1"}, expect_errors=True)
    assert installed.status_int == 400
    assert complete(client, BASE).json["choices"][0]["text"] == before


@pytest.mark.parametrize("route, body, status, param, words", [
    ("/v1/completions", {"model": "no-such-lora"}, 404, "model", "does not exist"),
    ("/v1/completions", {"model": "wide-lora"}, 400, "model", "does not fit the model"),
    ("/v1/chat/completions", {"model": "wide-lora", "messages": [{"role": "user", "content": "hi"}]}, 400, "model",
     "does not fit"),
    ("/v1/load_lora_adapter", {"lora_name": "skew", "lora_path": "spare/skew"}, 400, "model", "lora_B rank 3"),
    ("/v1/load_lora_adapter", {"lora_name": "up", "lora_path": "../outside0"}, 400, "lora_path", "inside the models"),
    ("/v1/load_lora_adapter", {"lora_name": "abs", "lora_path": "/etc"}, 400, "lora_path", "inside the models"),
    ("/v1/load_lora_adapter", {"lora_name": "miss", "lora_path": "spare/missing"}, 400, "model",
     "no adapter_model.safetensors"),
    ("/v1/load_lora_adapter", {"lora_name": "none", "lora_path": "spare/nothing-here"}, 400, "lora_path", "no directory"),
    ("/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": "spare/rt"}, 400, "lora_name", "taken"),
    ("/v1/load_lora_adapter", {"lora_name": 7, "lora_path": "spare/rt"}, 400, "lora_name", "non-empty string"),
    ("/v1/unload_lora_adapter", {}, 400, "lora_name", "non-empty string"),
])
def test_hostile_values_are_4xx_and_a_neighbour_finishes_untouched(client, route, body, status, param, words):
    alone = complete(client, "a1").json["choices"][0]["text"]
    out = {}
    neighbour = threading.Thread(target=lambda: out.setdefault("r", complete(client, "a1", max_tokens=24)))
    neighbour.start()
    if route != "/v1/load_lora_adapter" and route != "/v1/unload_lora_adapter":
        body = {"prompt": "x", "max_tokens": 4, **body} if route == "/v1/completions" else {"max_tokens": 4, **body}
    r = client.post_json(route, body, expect_errors=True)
    neighbour.join()
    assert r.status_int == status, r.text
    assert r.json["error"]["param"] == param and words in r.json["error"]["message"]
    assert "/" + "tmp" not in r.json["error"]["message"]       # no file system paths reach clients
    assert out["r"].status_int == 200 and out["r"].json["choices"][0]["text"].startswith(alone)
    assert complete(client, "a1").json["choices"][0]["text"] == alone
