"""The HTTP benchmark's statistics, SSE bookkeeping and report (tools/bench_http_*.py), without servers."""
import importlib
import json
import statistics
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def tools():
    sys.path.insert(0, str(TOOLS))
    try:
        yield (importlib.import_module("bench_http_report"), importlib.import_module("bench_http_load"),
               importlib.import_module("bench_http"))
    finally:
        sys.path.remove(str(TOOLS))


@pytest.fixture(scope="module")
def report_mod(tools):
    return tools[0]


@pytest.fixture(scope="module")
def load_mod(tools):
    return tools[1]


def test_percentile_interpolates_between_closest_ranks(report_mod):
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert report_mod.percentile(values, 0) == 1.0
    assert report_mod.percentile(values, 50) == statistics.median(values)
    assert report_mod.percentile(values, 100) == 5.0
    assert report_mod.percentile(values, 95) == pytest.approx(4.8)      # 4 + 0.8 * (5 - 4)
    assert report_mod.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert report_mod.percentile([7.0], 95) == 7.0
    assert report_mod.percentile([], 50) is None
    assert report_mod.percentile([None, 2.0], 50) == 2.0


def test_decode_rate_counts_gaps_between_first_and_last_token(report_mod):
    times = [0.5 + 0.01 * i for i in range(128)]                     # 127 gaps of 10 ms
    assert report_mod.decode_rate(times, 128) == pytest.approx(100.0)
    # usage may count more tokens than text chunks (a held-back character): the span is the same
    assert report_mod.decode_rate([1.0, 2.0], 11) == pytest.approx(10.0)
    assert report_mod.decode_rate([1.0], 1) is None
    assert report_mod.decode_rate([1.0, 1.0], 2) is None


def test_summarize_and_ratio(report_mod):
    assert report_mod.summarize([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert report_mod.summarize([None]) is None
    assert report_mod.ratio(3.0, 2.0) == 1.5
    assert report_mod.ratio(None, 2.0) is None
    assert report_mod.ratio(1.0, 0) is None


def _results():
    return {
        "turbospark": {"metrics": {"prefill_tok_s": [100.0, 300.0, 200.0], "overhead_s": [0.02, 0.01, 0.03],
                                   "c4_aggregate_tok_s": [80.0, 80.0, 80.0],
                                   "prefill_prompt_tokens": [512, 512, 512]},
                       "info": {"peak_rss_mib": 300.0, "load_start": 0.1, "load_end": 1.2, "startup_s": 4.0}},
        "llama.cpp": {"metrics": {"prefill_tok_s": [400.0, 400.0, 400.0], "overhead_s": [0.04, 0.04, 0.04],
                                  "c4_aggregate_tok_s": [40.0, 40.0, 40.0],
                                  "prefill_prompt_tokens": [511, 511, 511]},
                      "info": {"peak_rss_mib": 150.0, "load_start": 1.2, "load_end": 1.0, "startup_s": 1.0}},
    }


def test_report_ratios_are_ours_over_theirs_of_medians(report_mod):
    report = report_mod.build_report({"repeats": 3}, _results())
    assert report["ratios"]["prefill_tok_s"] == pytest.approx(0.5)    # 200 / 400
    assert report["ratios"]["overhead_s"] == pytest.approx(0.5)       # 0.02 / 0.04
    assert report["ratios"]["c4_aggregate_tok_s"] == pytest.approx(2.0)
    assert "prefill_prompt_tokens" not in report["ratios"]             # counts are not compared
    ours = report["servers"]["turbospark"]["metrics"]["prefill_tok_s"]
    assert (ours["median"], ours["min"], ours["max"]) == (200.0, 100.0, 300.0)
    assert ours["values"] == [100.0, 300.0, 200.0]
    assert json.loads(report_mod.to_json(report))["ratios"]["prefill_tok_s"] == pytest.approx(0.5)


def test_table_shows_medians_ranges_ratios_and_direction(report_mod):
    table = report_mod.format_table(report_mod.build_report({}, _results()))
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["metric", "turbospark", "llama.cpp"]
    prefill = next(line for line in lines if line.startswith("prefill tok/s"))
    assert "200.0 (100.0-300.0)" in prefill and "400.0 (400.0-400.0)" in prefill
    assert prefill.rstrip().endswith("0.50x  higher")
    def row(start):
        return next(line for line in lines if line.startswith(start)).rstrip()

    assert row(" 4 clients: aggregate").endswith("2.00x  higher")
    assert row("1-token").endswith("0.50x   lower")
    counts = row("prefill prompt tokens")
    assert "512 (512-512)" in counts and "511 (511-511)" in counts and counts.endswith("-")   # no ratio
    info = report_mod.format_info(report_mod.build_report({}, _results()))
    assert "turbospark: peak RSS 300 MiB; load average 0.10 -> 1.20; ready in 4.0 s" in info


def test_one_server_report_has_no_ratios(report_mod):
    only = {"turbospark": _results()["turbospark"]}
    report = report_mod.build_report({}, only)
    assert report["ratios"] == {}
    assert "-" in report_mod.format_table(report).splitlines()[2].split()


def test_stream_bookkeeping_for_completion_and_chat_chunks(load_mod):
    s = load_mod.Stream()
    s.add({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, 0.1)   # role first
    assert s.ttft is None
    s.add({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}, 0.5)
    s.add({"choices": [{"delta": {"content": "!"}, "finish_reason": None}]}, 0.6)
    s.add({"choices": [{"delta": {}, "finish_reason": "length"}]}, 0.7)
    assert (s.ttft, s.text, s.finish_reason, s.completion_tokens()) == (0.5, "Hi!", "length", 2)
    s.add({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}, 0.8)
    assert s.completion_tokens() == 3

    one = load_mod.Stream()                      # a single token with no text: the finish times it
    one.add({"choices": [{"text": "", "finish_reason": "length"}]}, 0.25)
    assert one.ttft == 0.25 and one.completion_tokens() == 0


def test_concurrent_summary_aggregates_over_wall_time(load_mod):
    def done(tokens):
        return load_mod.Stream(usage={"completion_tokens": tokens})

    failed = load_mod.Stream(error="HTTP 503")
    results = [(0.0, 2.0, done(64)), (0.5, 4.0, done(64)), (1.0, 1.5, failed)]
    summary = load_mod.summarize_concurrent(results)
    assert summary["aggregate_tok_s"] == pytest.approx(128 / 4.0)
    assert summary["p50_s"] == pytest.approx(2.75)                    # latencies 2.0 and 3.5
    assert (summary["tokens"], summary["errors"]) == (128, 1)


def test_fit_words_finds_the_longest_text_within_the_target(tools):
    bench_http = tools[2]
    count = lambda text: 1 + 2 * len(text.split())                      # BOS + two tokens a word
    n = bench_http.fit_words(count, bench_http.filler, 512)
    assert count(bench_http.filler(n)) <= 512 < count(bench_http.filler(n + 1))
