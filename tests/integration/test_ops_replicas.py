"""Scale-out: two gunicorn replicas (stories260K) behind real nginx with
tools/nginx/turbospark-replicas.conf. Requests spread across both; when one replica dies, the
next requests succeed on the other and no stream is ever delivered corrupted or falsely complete."""
import http.client
import json
import os
import signal
import threading
import time
from collections import Counter

import pytest

from ops_servers import REPO, ReplicaNginx, Server, models_dir_with_stories, request

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TEMPLATE = REPO / "tools" / "nginx" / "turbospark-replicas.conf"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("replicas")
    models = models_dir_with_stories(work / "models")
    replicas = {rid: Server(work, models=models, model="stories", replica_id=rid, max_waiting=16, threads=32)
                for rid in ("r1", "r2")}
    try:
        for srv in replicas.values():
            srv.wait_ready()
        nginx = ReplicaNginx(work, TEMPLATE, [s.port for s in replicas.values()])
        yield nginx.port, replicas, nginx.prefix
        nginx.stop()
    finally:
        for srv in replicas.values():
            srv.stop()


def completion(stream, max_tokens=24):
    return {"model": "stories", "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}


def stream_through(port, results):
    """One streamed completion; appends (replica, status, complete, frames ok)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(completion(True, 200)),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        replica = resp.getheader("x-turbospark-replica")
        try:
            raw = resp.read()
        except http.client.IncompleteRead as e:
            raw = e.partial
        results.append((replica, resp.status, *check_frames(raw)))
    except (OSError, http.client.HTTPException) as e:
        results.append((None, type(e).__name__, False, True))
    finally:
        conn.close()


def check_frames(raw):
    """(complete, well formed): every data frame is JSON with a choice, and [DONE] comes last if at all."""
    frames = [line[6:] for line in raw.decode(errors="replace").splitlines() if line.startswith("data: ")]
    complete = bool(frames) and frames[-1] == "[DONE]"
    body = frames[:-1] if complete else frames
    try:
        ok = all(json.loads(f)["choices"][0]["index"] == 0 for f in body)
    except (ValueError, KeyError, IndexError):
        ok = False
    if complete:
        ok = ok and json.loads(body[-1])["choices"][0]["finish_reason"] in ("stop", "length")
    return complete, ok


def test_requests_spread_across_replicas_and_a_dead_one_is_absorbed(stack):
    port, replicas, prefix = stack
    seen = Counter()
    for _ in range(12):
        status, headers, body = request(port, "POST", "/v1/completions", completion(False))
        assert status == 200 and json.loads(body)["choices"][0]["text"]
        seen[headers["x-turbospark-replica"]] += 1
    print(f"\nspread over replicas: {dict(seen)}")
    assert set(seen) == {"r1", "r2"} and min(seen.values()) >= 3

    results = []
    streams = [threading.Thread(target=stream_through, args=(port, results)) for _ in range(6)]
    for t in streams:
        t.start()
    time.sleep(0.05)
    victim = replicas["r1"]
    os.killpg(victim.proc.pid, signal.SIGKILL)           # master and worker, no goodbye
    victim.proc.wait(10)
    for t in streams:
        t.join(60)
    print("streams across the kill (replica, status, complete, well formed):", results)
    assert len(results) == 6
    for replica, status, complete, well_formed in results:
        assert well_formed                               # never a corrupted frame
        if replica == "r2":
            assert status == 200 and complete            # the survivor's streams are untouched

    after = Counter()
    for i in range(12):
        stream = i % 2 == 0
        status, headers, body = request(port, "POST", "/v1/completions", completion(stream))
        assert status == 200, (status, body, (prefix / "logs" / "error.log").read_text()[-2000:])
        if stream:
            assert check_frames(body) == (True, True)
        after[headers["x-turbospark-replica"]] += 1
    assert after == Counter({"r2": 12})
