"""The Batch API against create_app with the fake engine (tests/conftest.py): files (upload, list,
retrieve, content, delete, limits), batches (the lifecycle, per-line errors, a file that cannot
run, cancel, expiry, resume after a killed runner), each key's own, on disk and in Redis."""
import json
import time

import pytest

from turbospark_wsgi.http.batch_runner import BatchRunner
from turbospark_wsgi.http.schemas import batches
from turbospark_wsgi.serving.batch_store import open_batch_store

openai_types = pytest.importorskip("openai.types")

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789"}
FINAL = ("completed", "failed", "expired", "cancelled")


def auth(name):
    return {"Authorization": f"Bearer {KEYS[name]}"}


def chat_line(i, **body):
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": dict({"model": "fake", "messages": [{"role": "user", "content": f"question {i}"}],
                          "max_tokens": 4}, **body)}


def jsonl(lines):
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def upload(client, data, who="alice", purpose="batch", status=200, name="in.jsonl"):
    return client.post("/v1/files", {"purpose": purpose}, upload_files=[("file", name, data)], headers=auth(who),
                       status=status).json


def create(client, file_id, who="alice", endpoint="/v1/chat/completions", status=200, **extra):
    body = dict({"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}, **extra)
    return client.post_json("/v1/batches", body, headers=auth(who), status=status).json


def wait_final(client, batch_id, who="alice", timeout=20.0, until=FINAL):
    end = time.monotonic() + timeout
    while True:
        batch = client.get(f"/v1/batches/{batch_id}", headers=auth(who)).json
        if batch["status"] in until or time.monotonic() > end:
            return batch
        time.sleep(0.02)


def content(client, file_id, who="alice"):
    return [json.loads(line) for line in client.get(f"/v1/files/{file_id}/content", headers=auth(who)).text.splitlines()]


@pytest.fixture(params=["disk", "redis"])
def harness(request, make_harness):
    settings = {"api_keys": tuple(KEYS.values()), "batch_max_lines": 50, "batch_max_files": 6}
    if request.param == "redis":
        settings["redis"] = request.getfixturevalue("start_redis")().url       # its own: no other test's batches
    h = make_harness(**settings)
    h.engine("fake", reply="Paris is the capital.", max_context=1024)
    return h


@pytest.fixture
def client(harness):
    return harness.client()


# ---- files ----------------------------------------------------------------------------------------

def test_a_file_is_uploaded_listed_read_and_deleted_in_openai_shapes(client):
    data = jsonl([chat_line(0)])
    meta = upload(client, data)
    file = openai_types.FileObject.model_validate(meta)
    assert file.bytes == len(data) and file.purpose == "batch" and file.filename == "in.jsonl"
    assert client.get(f"/v1/files/{meta['id']}", headers=auth("alice")).json == meta
    assert client.get(f"/v1/files/{meta['id']}/content", headers=auth("alice")).body == data
    listed = client.get("/v1/files", headers=auth("alice")).json
    assert [f["id"] for f in listed["data"]] == [meta["id"]] and listed["object"] == "list"
    assert client.delete(f"/v1/files/{meta['id']}", headers=auth("alice")).json == {
        "id": meta["id"], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{meta['id']}", headers=auth("alice"), status=404).json["error"]["code"] == \
        "file_not_found"


def test_another_keys_files_and_batches_are_404_as_unknown_ids(client):
    meta = upload(client, jsonl([chat_line(0)]))
    batch = create(client, meta["id"])
    for path in (f"/v1/files/{meta['id']}", f"/v1/files/{meta['id']}/content", f"/v1/batches/{batch['id']}"):
        assert client.get(path, headers=auth("bob"), status=404).json["error"]["type"] == "invalid_request_error"
    client.delete(f"/v1/files/{meta['id']}", headers=auth("bob"), status=404)
    client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth("bob"), status=404)
    create(client, meta["id"], who="bob", status=404)
    assert client.get("/v1/files", headers=auth("bob")).json["data"] == []
    assert client.get("/v1/batches", headers=auth("bob")).json["data"] == []
    client.get("/v1/files", status=401)
    wait_final(client, batch["id"])


@pytest.mark.parametrize("bad_id", ["file-../../etc/passwd", "file-0", "x" * 5000, "file-%00"])
def test_ids_that_could_name_a_path_are_only_unknown(client, bad_id):
    client.get(f"/v1/files/{bad_id}", headers=auth("alice"), status=404)
    client.get(f"/v1/batches/{bad_id}", headers=auth("alice"), status=404)


def test_upload_refusals_name_what_is_wrong(client, harness):
    assert client.post("/v1/files", {"purpose": "batch"}, headers=auth("alice"), status=415).json["error"]
    err = client.post("/v1/files", {"purpose": "fine-tune"}, upload_files=[("file", "a.jsonl", b"{}")],
                      headers=auth("alice"), status=400).json["error"]
    assert err["param"] == "purpose"
    err = client.post("/v1/files", {"purpose": "batch", "other": "x"}, upload_files=[], headers=auth("alice"),
                      content_type="multipart/form-data; boundary=X", status=400).json["error"]
    assert err["message"]
    for _ in range(harness.config.batch_max_files):
        upload(client, b"{}\n")
    err = upload(client, b"{}\n", status=400)["error"]
    assert err["code"] == "file_limit_exceeded" and "TURBOSPARK_BATCH_MAX_FILES" in err["message"]
    upload(client, b"{}\n", who="bob")          # another key's own allowance


def test_a_file_over_the_size_limit_is_413_declared_or_not(make_harness):
    h = make_harness(batch_file_bytes=1000)
    client = h.client()
    err = client.post("/v1/files", {"purpose": "batch"}, upload_files=[("file", "big.jsonl", b"x" * 70_000)],
                      status=413).json["error"]
    assert "limit is 66536" in err["message"]       # its declared length: nothing read
    # over the file limit but under the body's: read and refused
    err = client.post("/v1/files", {"purpose": "batch"}, upload_files=[("file", "big.jsonl", b"x" * 1001)],
                      status=413).json["error"]
    assert "TURBOSPARK_BATCH_FILE_BYTES" in err["message"]


# ---- batches --------------------------------------------------------------------------------------

def test_a_batch_runs_every_line_as_the_same_request_sent_live(client):
    lines = [chat_line(i, max_tokens=2 + i % 4) for i in range(8)]
    batch = create(client, upload(client, jsonl(lines))["id"], metadata={"job": "eval"})
    assert batch["status"] == "validating" and batch["metadata"] == {"job": "eval"}
    done = openai_types.Batch.model_validate(wait_final(client, batch["id"]))
    assert done.status == "completed" and done.error_file_id is None
    assert done.request_counts.total == done.request_counts.completed == 8 and done.request_counts.failed == 0
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = content(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(8)]
    for line, o in zip(lines, out):
        live = client.post_json("/v1/chat/completions", line["body"], headers=auth("alice")).json
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert o["response"]["body"]["choices"] == live["choices"] and o["response"]["body"]["usage"] == live["usage"]
    assert done.usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
    output_file = client.get(f"/v1/files/{done.output_file_id}", headers=auth("alice")).json
    assert output_file["purpose"] == "batch_output"
    assert [b["id"] for b in client.get("/v1/batches", headers=auth("alice")).json["data"]] == [batch["id"]]


def sample(text, name, **labels):
    """The value of one /metrics sample (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_bad_lines_go_to_the_error_file_and_the_others_complete(client):
    before = client.get("/metrics", headers=auth("alice")).text
    lines = [chat_line(0), "not json {", chat_line(1, max_tokens=-3), dict(chat_line(2), url="/v1/completions"),
             chat_line(0), dict(chat_line(3), custom_id=7), chat_line(4, stream=True), chat_line(5)]
    done = wait_final(client, create(client, upload(client, jsonl(lines))["id"])["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 8, "completed": 2, "failed": 6}
    assert [o["custom_id"] for o in content(client, done["output_file_id"])] == ["req-0", "req-5"]
    errors = content(client, done["error_file_id"])
    codes = [(e["custom_id"], (e["error"] or {}).get("code"), (e["response"] or {}).get("status_code"))
             for e in errors]
    assert codes == [(None, "invalid_json_line", None), ("req-1", None, 400),
                     ("req-2", "mismatched_endpoint", None), ("req-0", "duplicate_custom_id", None),
                     (None, "missing_custom_id", None), ("req-4", "invalid_request", None)]
    assert errors[1]["response"]["body"]["error"]["param"] == "max_tokens"
    after = client.get("/metrics", headers=auth("alice")).text
    for name, labels, grew in (("turbospark_batch_lines_total", {"result": "output"}, 2),
                               ("turbospark_batch_lines_total", {"result": "error"}, 6),
                               ("turbospark_batches_total", {"status": "completed"}, 1)):
        assert sample(after, name, **labels) - sample(before, name, **labels) == grew


@pytest.mark.parametrize("data, code", [(b"", "empty_file"), (b"\xff\xfe\n", "invalid_file"),
                                        (jsonl([chat_line(i) for i in range(51)]), "too_many_requests")])
def test_a_file_that_cannot_run_fails_the_batch_with_its_errors(client, data, code):
    done = wait_final(client, create(client, upload(client, data)["id"])["id"])
    assert done["status"] == "failed" and done["failed_at"]
    assert done["errors"]["data"][0]["code"] == code
    openai_types.Batch.model_validate(done)


def test_create_refusals_name_their_param(client):
    fid = upload(client, jsonl([chat_line(0)]))["id"]
    user = upload(client, b"{}", purpose="user_data")["id"]
    cases = [({"endpoint": "/v1/chat/completions"}, "input_file_id"),
             ({"input_file_id": fid, "endpoint": "/v1/moderations"}, "endpoint"),
             ({"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "forever"},
              "completion_window"),
             ({"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "999h"}, "completion_window"),
             ({"input_file_id": fid, "endpoint": "/v1/completions", "metadata": {"k": 1}}, "metadata"),
             ({"input_file_id": fid, "endpoint": "/v1/completions", "bogus": 1}, "bogus"),
             ({"input_file_id": user, "endpoint": "/v1/completions"}, "input_file_id")]
    for body, param in cases:
        err = client.post_json("/v1/batches", body, headers=auth("alice"), status=400).json["error"]
        assert err["param"] == param, body
    assert client.post_json("/v1/batches", {"input_file_id": "file-" + "0" * 24, "endpoint": "/v1/completions"},
                            headers=auth("alice"), status=404).json["error"]["param"] == "input_file_id"
    client.get("/v1/batches?limit=0", headers=auth("alice"), status=400)


def test_cancel_stops_a_running_batch_and_keeps_its_finished_lines(make_harness):
    h = make_harness(api_keys=tuple(KEYS.values()))
    h.engine("fake", reply="a long answer " * 20, max_context=1024, step_delay=0.01)
    client = h.client()
    batch = create(client, upload(client, jsonl([chat_line(i, max_tokens=20) for i in range(40)]))["id"])
    wait_final(client, batch["id"], until=("in_progress",))
    end = time.monotonic() + 10
    while client.get(f"/v1/batches/{batch['id']}", headers=auth("alice")).json["request_counts"]["completed"] < 2:
        assert time.monotonic() < end
        time.sleep(0.02)
    cancelling = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth("alice")).json
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"]
    done = wait_final(client, batch["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"]
    counts = done["request_counts"]
    assert 2 <= counts["completed"] < 40 and counts["total"] == 40
    assert len(content(client, done["output_file_id"])) == counts["completed"]
    # a final batch stays as it is
    assert client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth("alice")).json["status"] == "cancelled"


def test_a_batch_past_its_window_expires_with_what_it_finished(make_harness):
    h = make_harness()
    h.engine("fake", reply="slow " * 20, max_context=1024, step_delay=0.01)
    client = h.client()
    fid = client.post("/v1/files", {"purpose": "batch"},
                      upload_files=[("file", "in.jsonl", jsonl([chat_line(i, max_tokens=30) for i in range(100)]))]).json
    batch = client.post_json("/v1/batches", {"input_file_id": fid["id"], "endpoint": "/v1/chat/completions",
                                             "completion_window": "1s"}).json
    end = time.monotonic() + 20
    while (done := client.get(f"/v1/batches/{batch['id']}").json)["status"] not in FINAL:
        assert time.monotonic() < end
        time.sleep(0.05)
    assert done["status"] == "expired" and done["expired_at"] and done["request_counts"]["completed"] < 100


def test_a_runner_that_died_is_resumed_without_running_a_finished_line_again(make_harness):
    h = make_harness()
    engine = h.engine("fake", reply="ok", max_context=1024)
    client = h.client()
    lines = [chat_line(i) for i in range(6)]
    fid = client.post("/v1/files", {"purpose": "batch"}, upload_files=[("file", "in.jsonl", jsonl(lines))]).json["id"]
    store = open_batch_store(h.config)
    # the batch as a killed worker left it: in progress, lines 0 and 2 finished, line 3 torn mid-write
    req = batches.parse_batch({"input_file_id": fid, "endpoint": "/v1/chat/completions"})
    record = batches.new_batch(req)
    record["status"] = "in_progress"
    store.create_batch("", record, {"key": None, "address": "127.0.0.1"})
    for i in (0, 2):
        store.append(record["id"], "output", i, batches.output_line(f"req-{i}", 200, "req-x", {"earlier": i}))
    store.backend.append(f"batch/{record['id']}.output", b'3 {"id": "batch_req_torn", "cust')
    runner = BatchRunner(h.app(), store, h.config)
    assert runner.run_pending()
    done = store.batch("", record["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    asked = [bytes(t - 3 for t in run.ids[1:]).decode() for run in engine.runs]
    assert sorted(q for q in asked) == sorted(f"<user>question {i}<assistant>" for i in (1, 3, 4, 5))
    out = {o["custom_id"]: o for o in map(json.loads, store.content("", done["output_file_id"]).decode().splitlines())}
    assert sorted(out) == [f"req-{i}" for i in range(6)]
    assert out["req-0"]["response"]["body"] == {"earlier": 0}
    assert all(run.background for run in engine.runs)        # batch lines run below live traffic


def test_a_line_refused_for_the_moment_waits_and_goes_again(make_harness, monkeypatch):
    h = make_harness()
    h.engine("fake", reply="ok", max_context=1024)
    store = open_batch_store(h.config)
    runner = BatchRunner(h.app(), store, h.config)
    answers = iter([(429, {"retry-after": "0.05"}, {"error": {"code": "rate_limit_exceeded"}}),
                    (503, {"retry-after": "0.05"}, {"error": {"code": "server_overloaded"}})])
    real = runner.call
    monkeypatch.setattr(runner, "call", lambda doc, path, body: next(answers, None) or real(doc, path, body))
    line = batches.Line(0, "a", {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                        None)
    kind, text = runner._one(line, {"sender": None}, "/v1/chat/completions", lambda: False)
    assert kind == "output" and json.loads(text)["response"]["status_code"] == 200
    assert next(answers, "spent") == "spent"


def test_replicas_share_batches_through_redis_and_any_one_serves_its_status_and_output(make_harness, start_redis):
    url = start_redis().url
    replicas = []
    for concurrency in (2, 0):              # the second replica runs no batch lines: it only answers
        h = make_harness(api_keys=tuple(KEYS.values()), redis=url, batch_concurrency=concurrency)
        h.engine("fake", reply="Shared.", max_context=1024)
        replicas.append(h.client())
    a, b = replicas
    fid = upload(b, jsonl([chat_line(i) for i in range(3)]))["id"]
    assert a.get(f"/v1/files/{fid}", headers=auth("alice")).json["id"] == fid
    batch = create(b, fid)
    # a server's runner starts at boot; this test app's starts with its first batch, and with Redis it
    # looks for every replica's batches, so it takes b's too
    create(a, fid)
    done = wait_final(b, batch["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 3
    assert content(b, done["output_file_id"]) == content(a, done["output_file_id"])
    b.get(f"/v1/batches/{batch['id']}", headers=auth("bob"), status=404)


def test_batch_lines_count_against_the_keys_limits(make_harness, tmp_path):
    from turbospark_wsgi.serving.limits import Limits, MemoryStore

    path = tmp_path / "limits.toml"
    path.write_text(f'[keys.alice]\nsha256 = "{__import__("hashlib").sha256(KEYS["alice"].encode()).hexdigest()}"\n'
                    "requests_per_minute = 5\n")
    h = make_harness(api_keys=tuple(KEYS.values()), limits_file=str(path))
    h.engine("fake", reply="ok", max_context=1024)
    h.service.limits = Limits(str(path), True, MemoryStore(clock=lambda: 1_800_000_000.0))   # no refill
    client = h.client()
    done = wait_final(client, create(client, upload(client, jsonl([chat_line(i) for i in range(3)]))["id"])["id"])
    assert done["request_counts"]["completed"] == 3
    body = chat_line(9)["body"]
    for _ in range(2):                      # 3 of the key's 5 requests went to the batch
        client.post_json("/v1/chat/completions", body, headers=auth("alice"))
    client.post_json("/v1/chat/completions", body, headers=auth("alice"), status=429)
    client.post_json("/v1/chat/completions", body, headers=auth("bob"))      # another key is served
