"""Faults on a real gunicorn with stories260K: clients leaving at random points, a worker killed
mid-stream, and broken model files next to a good one."""
import http.client
import json
import os
import random
import signal
import socket
import threading
import time

import pytest

from ops_servers import Server, models_dir_with_stories, sse_data, stories_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def gguf_with_architecture(source, target, arch):
    """A copy of `source` whose general.architecture string is replaced (same length)."""
    data = bytearray(source.read_bytes())
    key = b"general.architecture"
    at = data.index(key) + len(key) + 4 + 8          # value type (u32), string length (u64)
    old = bytes(data[at:at + len(arch)])
    assert old == b"llama" and len(arch) == 5
    data[at:at + 5] = arch.encode()
    target.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("faults")
    models = models_dir_with_stories(work / "models")
    source = stories_model()
    (models / "truncated.gguf").write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    gguf_with_architecture(source, models / "alien.gguf", "zorro")
    srv = Server(work, models=models, model="stories", max_waiting=8, threads=48, prefill_chunk=4)
    yield srv.wait_ready()
    srv.stop()


def completion(model="stories", max_tokens=8, stream=False, prompt="Once upon a time"):
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def wait_drained(server, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queue = json.loads(server.get("/health")[2])["queue"]
        if queue["waiting"] == 0 and queue["running"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"queue not drained: {queue}")


# ---- broken model files ------------------------------------------------------------------------

@pytest.mark.parametrize("model, words", [("truncated", "truncated GGUF file"),
                                          ("alien", "unsupported model architecture 'zorro'")])
def test_broken_models_are_refused_by_name_and_the_rest_keeps_serving(server, model, words):
    status, _, body = server.post("/v1/completions", completion(model))
    error = json.loads(body)["error"]
    assert status == 500 and error["code"] == "model_load_failed"
    assert f"'{model}'" in error["message"] and words in error["message"], error
    status, _, body = server.post("/v1/completions", completion())
    assert status == 200 and json.loads(body)["choices"][0]["text"]
    listed = {m["id"]: m["loaded"] for m in json.loads(server.get("/v1/models")[2])["data"]}
    assert listed["stories"] is True and listed[model] is False


# ---- clients leaving at random points -----------------------------------------------------------

def leave_at_random(port, rng):
    """One request whose client leaves while queued, in prefill or mid-decode (streamed or not)."""
    stream = rng.random() < 0.5
    long_prompt = "Once upon a time " * rng.randint(1, 40)          # several prefill chunks
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(completion(max_tokens=200, stream=stream,
                                                                        prompt=long_prompt)),
                 headers={"Content-Type": "application/json"})
    if stream and rng.random() < 0.7:
        resp = conn.getresponse()
        for _ in range(rng.randint(1, 12)):                         # ": ok", then data events
            if not resp.readline():
                break
    else:
        time.sleep(rng.uniform(0, 0.3))
    try:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0") if rng.random() < 0.3 else None
        conn.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def test_random_disconnects_leak_no_slot_and_no_memory(server):
    rng = random.Random(7)
    pids = server.worker_pids()
    for _ in range(20):                                             # warm-up
        leave_at_random(server.port, rng)
    wait_drained(server)
    rss_before = server.worker_rss()
    for round_ in range(3):
        threads = [threading.Thread(target=leave_at_random, args=(server.port, random.Random(round_ * 100 + i)))
                   for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        wait_drained(server)
    rss_after = server.worker_rss()
    print(f"\nworker RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB after 72 abandoned requests")
    assert server.metric("turbospark_queue_waiting") == 0 and server.metric("turbospark_queue_running") == 0
    status, _, body = server.post("/v1/completions", completion())
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.worker_pids() == pids
    assert rss_after - rss_before < 30 * 2**20, (rss_before, rss_after)


# ---- a worker killed mid-stream ------------------------------------------------------------------

def test_a_worker_killed_mid_stream_is_replaced_and_the_next_request_succeeds(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(completion(max_tokens=400, stream=True)),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    victim = int(resp.getheader("x-turbospark-replica").rsplit(":", 1)[1])     # host:pid of the worker
    assert victim in server.worker_pids()
    while not resp.readline().startswith(b"data: "):
        pass
    os.kill(victim, signal.SIGKILL)
    try:
        rest = resp.read()
    except http.client.IncompleteRead as e:      # the chunked body ends without its last chunk
        rest = e.partial
    conn.close()
    assert b"[DONE]" not in rest                     # the stream is cut, never falsely completed
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = server.worker_pids()
        if pids and victim not in pids and server.get("/health")[0] == 200:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"no healthy replacement worker:\n{server.tail()}")
    status, headers, body = server.post("/v1/completions", completion(stream=True))
    assert status == 200 and sse_data(body)[-1] == "[DONE]"
    assert int(headers["x-turbospark-replica"].rsplit(":", 1)[1]) != victim
