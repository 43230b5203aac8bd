"""A full server says so at once: real gunicorn (gthread) with stories260K, its running batch and
its queue held by long streams, then a burst of short requests that must all be refused fast.

The bounds are loose (2 shared cores); tools/bench_reject.py measures the real figures.
"""
import importlib
import statistics
import sys

import pytest

from ops_servers import REPO, Server, models_dir_with_stories

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SLOTS, MAX_WAITING, BURST = 2, 8, 150


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        yield importlib.import_module("bench_reject")
    finally:
        sys.path.remove(str(REPO / "tools"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("reject")
    srv = Server(work, models=models_dir_with_stories(work / "models"), model="stories",
                 max_waiting=MAX_WAITING, max_batch=SLOTS)
    yield srv.wait_ready()
    srv.stop()


@pytest.mark.parametrize("route", ["chat", "completions", "messages"])
def test_a_burst_against_a_full_server_is_refused_fast(server, bench, route):
    pids = server.worker_pids()
    # NOTE(fillers): plain completion streams keep the compute thread busy on every route's test
    # without the chat parsers' per-token work, which would only add noise to the timings.
    summary, results, queue = bench.measure(server.port, route, BURST, slots=SLOTS, rounds=2, filler_tokens=400,
                                            filler_route="completions")
    print(f"\n{route}: {summary}")
    assert queue["waiting"] == MAX_WAITING and queue["running"] == SLOTS
    # NOTE(fillers): a stream may end just before a burst; the few requests that then fit are admitted.
    assert set(summary["statuses"]) <= {"503", "200"}, summary
    rejected = [r for r in results if r["status"] == 503]
    assert len(rejected) >= 0.9 * len(results), summary
    assert all(bench.well_formed_503(r, route) for r in rejected), "a 503 without Retry-After or its envelope"
    times = [r["seconds"] for r in rejected]
    assert statistics.median(times) < 0.1, summary
    assert max(times) < 1.0, summary
    assert server.worker_pids() == pids, "a worker restarted"
    assert "Traceback" not in server.tail(400)
