"""The Batch API driven by the official openai SDK against real gunicorn with stories260K: 200 mixed
lines each equal to the same request sent live (greedy), a malformed line in the error file, cancel
mid-batch, another key's 404s, and a worker SIGKILLed mid-batch whose replacement finishes the batch
without running a finished line again."""
import json
import os
import signal
import time

import pytest

from ops_servers import Server, models_dir_with_stories

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS = ("sk-batch-alice-000", "sk-batch-bob-000")
PROMPTS = ["Once upon a time", "The little dog", "Lily went to the park and", "Tom had a red", "A cat sat",
           "The sun was", "Ben and Mia", "There was a big", "One day", "The bird"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("batches")
    srv = Server(work, models=models_dir_with_stories(work / "models"), model="stories", max_batch=4,
                 api_keys=",".join(KEYS), data=work / "data", batch_concurrency=2, threads=24)
    srv.data = work / "data"
    yield srv.wait_ready()
    srv.stop()


def client(server, key=KEYS[0]):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0, timeout=60)


def mixed_line(i):
    body = {"model": "stories", "prompt": PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS) % 2),
            "max_tokens": 4 + i % 13, "temperature": 0}
    if i % 5 == 1:
        body["logprobs"] = 2
    if i % 7 == 3:
        body["stop"] = ["."]
    if i % 11 == 4:
        body["echo"] = True
    if i % 9 == 2:
        body["n"] = 2
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body}


def long_lines(prefix, count, tokens):
    """`count` completions lines of `tokens` tokens each (`ignore_eos`): a batch that runs a while."""
    return [{"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "stories", "prompt": PROMPTS[i % 10], "max_tokens": tokens, "temperature": 0,
                      "ignore_eos": True}} for i in range(count)]


def submit(oai, lines, endpoint="/v1/completions", raw_extra=b""):
    data = "".join(json.dumps(line) + "\n" for line in lines).encode() + raw_extra
    batch_file = oai.files.create(file=("requests.jsonl", data), purpose="batch")
    return oai.batches.create(input_file_id=batch_file.id, endpoint=endpoint, completion_window="24h")


def wait(oai, batch_id, until=("completed", "failed", "cancelled", "expired"), timeout=300, done_at_least=None):
    end = time.monotonic() + timeout
    while True:
        try:
            batch = oai.batches.retrieve(batch_id)
        except openai.APIConnectionError:       # a worker being replaced
            assert time.monotonic() < end
            time.sleep(0.2)
            continue
        if batch.status in until and (done_at_least is None or batch.request_counts.completed >= done_at_least):
            return batch
        assert time.monotonic() < end, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def lines_of(oai, file_id):
    return [json.loads(line) for line in oai.files.content(file_id).text.splitlines()]


def test_200_mixed_lines_each_equal_the_request_sent_live_and_a_bad_line_is_reported(server):
    oai = client(server)
    lines = [mixed_line(i) for i in range(200)]
    batch = submit(oai, lines, raw_extra=b'{"custom_id": "broken", "method": "POST", "url": \n')
    assert batch.status == "validating"
    done = wait(oai, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (201, 200, 1)
    out = {o["custom_id"]: o for o in lines_of(oai, done.output_file_id)}
    assert sorted(out) == sorted(line["custom_id"] for line in lines)
    for line in lines:
        live = oai.completions.create(**line["body"]).model_dump()
        got = out[line["custom_id"]]["response"]
        assert got["status_code"] == 200
        assert got["body"]["choices"] == json.loads(json.dumps(live["choices"])), line
        assert got["body"]["usage"]["completion_tokens"] == live["usage"]["completion_tokens"]
    errors = lines_of(oai, done.error_file_id)
    assert len(errors) == 1 and errors[0]["error"]["code"] == "invalid_json_line"
    assert done.usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out.values())


def test_an_embeddings_batch_equals_the_live_vectors(server):
    oai = client(server)
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "stories", "input": PROMPTS[i]}} for i in range(4)]
    done = wait(oai, submit(oai, lines, endpoint="/v1/embeddings").id)
    assert done.status == "completed" and done.request_counts.completed == 4
    for o, line in zip(lines_of(oai, done.output_file_id), lines):
        live = oai.embeddings.create(**line["body"], encoding_format="float")
        assert o["response"]["body"]["data"][0]["embedding"] == live.data[0].embedding


def test_cancel_mid_batch_keeps_the_finished_lines(server):
    oai = client(server)
    batch = submit(oai, long_lines("c", 200, 200))
    wait(oai, batch.id, until=("in_progress",), done_at_least=2)
    assert oai.batches.cancel(batch.id).status == "cancelling"
    done = wait(oai, batch.id)
    assert done.status == "cancelled" and 2 <= done.request_counts.completed < 200
    assert len(lines_of(oai, done.output_file_id)) == done.request_counts.completed


def test_another_key_gets_404_for_every_file_and_batch(server):
    alice, bob = client(server), client(server, KEYS[1])
    batch = submit(alice, [mixed_line(0)])
    for call in (lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id),
                 lambda: bob.files.retrieve(batch.input_file_id), lambda: bob.files.content(batch.input_file_id),
                 lambda: bob.files.delete(batch.input_file_id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [b.id for b in bob.batches.list()] == []
    assert batch.id in [b.id for b in alice.batches.list()]
    wait(alice, batch.id)


def finished_lines(server, batch_id):
    """{index: request id} of the lines the batch's log holds (what a runner had finished)."""
    path = server.data / "batch" / f"{batch_id}.output"
    found = {}
    for raw in path.read_bytes().split(b"\n")[:-1] if path.exists() else []:
        index, _, line = raw.decode().partition(" ")
        found[int(index)] = json.loads(line)["response"]["request_id"]
    return found


def test_a_worker_killed_mid_batch_is_replaced_and_finishes_it_without_running_a_line_twice(server):
    oai = client(server)
    batch = submit(oai, long_lines("k", 60, 120))
    wait(oai, batch.id, until=("in_progress",), done_at_least=5)
    [victim] = server.worker_pids()
    os.kill(victim, signal.SIGKILL)
    before = finished_lines(server, batch.id)
    assert 5 <= len(before) < 60
    done = wait(oai, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 60
    assert server.worker_pids() and server.worker_pids() != [victim]
    out = lines_of(oai, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"k{i}" for i in range(60))      # each once
    by_id = {o["custom_id"]: o["response"]["request_id"] for o in out}
    assert all(by_id[f"k{i}"] == rid for i, rid in before.items())      # finished before the kill: not run again


def test_under_the_gevent_worker_a_batch_completes_beside_live_requests(tmp_path_factory):
    work = tmp_path_factory.mktemp("batches-gevent")
    srv = Server(work, worker_class="gevent", models=models_dir_with_stories(work / "models"), model="stories",
                 max_batch=4, data=work / "data")
    try:
        oai = client(srv.wait_ready(), key="x")
        lines = [mixed_line(i) for i in range(30)]
        batch = submit(oai, lines)
        live = [oai.completions.create(**mixed_line(i)["body"]) for i in range(5)]     # served meanwhile
        done = wait(oai, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 30
        out = {o["custom_id"]: o for o in lines_of(oai, done.output_file_id)}
        for i, reply in enumerate(live):
            assert out[f"line-{i}"]["response"]["body"]["choices"] == json.loads(json.dumps(
                reply.model_dump()["choices"]))
    finally:
        srv.stop()
