"""/metrics on real gunicorn in multiprocess mode (PROMETHEUS_MULTIPROC_DIR): counts survive a
worker being replaced, and the queue gauges of a dead worker are dropped."""
import json
import os
import signal
import time

import pytest

from ops_servers import Server, models_dir_with_stories

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_multiprocess_metrics_sum_across_worker_lifetimes(tmp_path):
    multiproc = tmp_path / "prom"
    multiproc.mkdir()
    (multiproc / "stale_counter_1.db").write_bytes(b"left by an earlier run")
    server = Server(tmp_path, models=models_dir_with_stories(tmp_path / "models"), model="stories",
                    env={"PROMETHEUS_MULTIPROC_DIR": str(multiproc)}).wait_ready()
    try:
        assert not (multiproc / "stale_counter_1.db").exists()          # wiped at start
        body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        for _ in range(3):
            assert server.post("/v1/completions", body)[0] == 200
        assert server.metric("turbospark_requests_total", route="/v1/completions", status="200") == 3
        assert server.metric("turbospark_generation_tokens_total", model="stories") == 12

        victim = server.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pids = server.worker_pids()
            if pids and victim not in pids and server.get("/health")[0] == 200:
                break
            time.sleep(0.2)
        assert server.post("/v1/completions", body)[0] == 200
        assert server.metric("turbospark_requests_total", route="/v1/completions", status="200") == 4
        assert server.metric("turbospark_model_loads_total", model="stories", outcome="ok") == 2
        assert server.metric("turbospark_queue_running") == 0
        assert json.loads(server.get("/health")[2])["queue"]["running"] == 0
    finally:
        server.stop()
