"""tools/bench_affinity.py without servers: the request order, the nginx config of each setup and
the summary."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_affinity
        yield bench_affinity
    finally:
        sys.path.remove(str(TOOLS))


def test_the_order_is_shuffled_with_each_conversations_turns_in_order(bench):
    args = SimpleNamespace(conversations=10, turns=3, seed=0)
    order = bench.schedule(args)
    assert sorted(order) == [(c, t) for c in range(10) for t in range(3)]
    assert order != sorted(order, key=lambda ct: (ct[1], ct[0])) and bench.schedule(args) == order
    for c in range(10):
        assert [t for cc, t in order if cc == c] == [0, 1, 2]


def test_the_proxy_configs_differ_only_in_the_hash(bench):
    text = bench.NGINX_CONF.read_text()
    affinity = bench.proxy_conf(text, [7001, 7002], 9000, True)
    plain = bench.proxy_conf(text, [7001, 7002], 9000, False)
    assert "server 127.0.0.1:8001" not in affinity and affinity.count("server 127.0.0.1:700") == 2
    assert "hash $turbospark_affinity consistent;" in affinity and "listen 127.0.0.1:9000;" in affinity
    assert [line for line in affinity.splitlines() if line not in plain.splitlines()] == [
        "    hash $turbospark_affinity consistent;   # ketama: a replica leaving moves only its own share"]


def test_the_summary_takes_medians_and_counts_turns_on_the_same_replica(bench):
    runs = [[(2.0, 0, "a"), (0.1, 600, "a"), (0.2, 640, "a")], [(4.0, 0, "a"), (4.0, 0, "b"), (0.4, 600, "a")]]
    summary = bench.summarize("x", runs, SimpleNamespace(turns=3))
    second, third = summary["turns"][1:]
    assert second["same_replica"] == 0.5 and third["same_replica"] == 0.5
    assert second["ratio_to_turn_1"] == pytest.approx((0.05 + 1.0) / 2) and third["cached_tokens"] == 620
