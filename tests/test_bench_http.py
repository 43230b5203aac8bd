"""The HTTP benchmark's statistics, SSE bookkeeping, rounds and report (tools/bench_http*.py,
tools/bench_engine_batch.py), without servers."""
import importlib
import json
import statistics
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def tools():
    sys.path.insert(0, str(TOOLS))
    try:
        yield (importlib.import_module("bench_http_report"), importlib.import_module("bench_http_load"),
               importlib.import_module("bench_http"), importlib.import_module("bench_engine_batch"),
               importlib.import_module("bench_http_servers"))
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
        "turbospark": {"metrics": {"prefill_tok_s": [100.0, 300.0, 200.0], "short_ttft_s": [0.02, 0.01, 0.03],
                                   "c4_aggregate_tok_s": [80.0, 80.0, 80.0],
                                   "prefill_prompt_tokens": [512, 512, 512]},
                       "info": {"peak_rss_mib": 300.0, "startup_s": 4.0}},
        "llama-server": {"metrics": {"prefill_tok_s": [400.0, 400.0, 400.0], "short_ttft_s": [0.04, 0.04, 0.04],
                                     "c4_aggregate_tok_s": [40.0, 40.0, 40.0],
                                     "prefill_prompt_tokens": [511, 511, 511]},
                         "info": {"peak_rss_mib": 150.0, "startup_s": 1.0}},
    }


def test_report_ratios_are_ours_over_theirs_of_medians(report_mod):
    report = report_mod.build_report({"repeats": 3}, _results())
    assert report["ratios"]["prefill_tok_s"] == pytest.approx(0.5)    # 200 / 400
    assert report["ratios"]["short_ttft_s"] == pytest.approx(0.5)     # 0.02 / 0.04
    assert report["ratios"]["c4_aggregate_tok_s"] == pytest.approx(2.0)
    assert "prefill_prompt_tokens" not in report["ratios"]             # counts are not compared
    ours = report["servers"]["turbospark"]["metrics"]["prefill_tok_s"]
    assert (ours["median"], ours["min"], ours["max"]) == (200.0, 100.0, 300.0)
    assert ours["values"] == [100.0, 300.0, 200.0]
    assert json.loads(report_mod.to_json(report))["ratios"]["prefill_tok_s"] == pytest.approx(0.5)


def test_table_shows_medians_ranges_ratios_and_direction(report_mod):
    table = report_mod.format_table(report_mod.build_report({}, _results()))
    lines = table.splitlines()
    assert lines[0].split() == ["metric", "turbospark", "llama-server", "ours/llama-server", "better"]
    prefill = next(line for line in lines if line.startswith("prefill tok/s"))
    assert "200.0 (100.0-300.0)" in prefill and "400.0 (400.0-400.0)" in prefill
    assert prefill.rstrip().endswith("0.50x  higher")
    def row(start):
        return next(line for line in lines if line.startswith(start)).rstrip()

    assert row(" 4 clients: aggregate").endswith("2.00x  higher")
    assert row("TTFT s, ~12-token").endswith("0.50x   lower")
    counts = row("prefill prompt tokens")
    assert "512 (512-512)" in counts and "511 (511-511)" in counts and counts.endswith("-")   # no ratio
    meta = {"load_start": 0.5, "load_per_round": [1.25, 2.0], "load_end": 1.0, "cpu_count": 2}
    info = report_mod.format_info(report_mod.build_report(meta, _results())).splitlines()
    assert info[0] == "load average 0.50 at start; 1.25, 2.00 at each round; 1.00 at end (2 CPUs)"
    assert info[1] == "turbospark: peak RSS 300 MiB; ready in 4.0 s"


def test_one_server_report_has_no_ratios(report_mod):
    only = {"turbospark": _results()["turbospark"]}
    report = report_mod.build_report({}, only)
    assert report["ratios"] == {} and report["peer_ratios"] == {}
    table = report_mod.format_table(report).splitlines()
    assert table[0].split() == ["metric", "turbospark", "better"]
    assert table[2].split()[-2:] == ["(100.0-300.0)", "higher"]


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


@pytest.fixture(scope="module")
def bench_http(tools):
    return tools[2]


def test_three_servers_get_a_ratio_column_per_peer_and_the_anchor_is_llama_server(report_mod):
    results = dict(_results(), **{"llama-cpp-python": {
        "metrics": {"prefill_tok_s": [100.0, 100.0, 100.0], "c4_aggregate_tok_s": [20.0, 20.0, 20.0]},
        "info": {}}})
    report = report_mod.build_report({}, results)
    assert report["ratios"] == report["peer_ratios"]["llama-server"]
    assert report["peer_ratios"]["llama-cpp-python"]["prefill_tok_s"] == pytest.approx(2.0)
    assert report["peer_ratios"]["llama-cpp-python"]["short_ttft_s"] is None       # it has no such figure
    lines = report_mod.format_table(report).splitlines()
    assert lines[0].split() == ["metric", "turbospark", "llama-server", "llama-cpp-python",
                                "ours/llama-server", "ours/llama-cpp-python", "better"]
    aggregate = next(line for line in lines if line.startswith(" 4 clients: aggregate")).split()
    assert aggregate[-3:] == ["2.00x", "4.00x", "higher"]


def test_engine_only_and_load_metrics_are_labelled_and_oriented(report_mod):
    assert report_mod.label("engine_c8_aggregate_tok_s") == " 8 streams engine-only: aggregate tok/s"
    assert report_mod.label("c8_http_over_engine") == " 8 clients: over HTTP / engine-only"
    assert report_mod.label("c32_p95_s") == "32 clients: p95 latency s"
    assert report_mod.higher_is_better("c8_http_over_engine")
    assert not report_mod.higher_is_better("first_over_warm")
    assert report_mod.is_count("others_cpu_cores") and not report_mod.is_count("c8_p50_s")
    report = report_mod.build_report({}, {"turbospark": {"metrics": {"others_cpu_cores": [0.25, 0.5, 1.0]},
                                                         "info": {}}})
    assert "0.5000 (0.2500-1.0)" in report_mod.format_table(report)


def test_clients_and_servers_flags(bench_http):
    assert bench_http.parse_args([]).clients == [1, 8, 16]
    args = bench_http.parse_args(["--clients", "32,1,8,16,8", "--servers", "turbospark,llama-server"])
    assert args.clients == [1, 8, 16, 32] and args.servers == ["turbospark", "llama-server"]
    assert args.llama_server == str(TOOLS.parent / "build" / "llama.cpp" / "bin" / "llama-server")     # the build script's
    with pytest.raises(SystemExit):
        bench_http.parse_args(["--servers", "vllm"])
    with pytest.raises(SystemExit):
        bench_http.parse_args(["--clients", "0,8"])


def test_requests_are_greedy_unless_a_temperature_is_given(bench_http, load_mod):
    assert load_mod.completion_body("p", 4)["temperature"] == 0
    assert load_mod.chat_body([], 4)["temperature"] == 0
    args = bench_http.parse_args(["--temperature", "1"])
    body = load_mod.completion_body("p", 4, bench_http.sampling_of(args))
    assert (body["temperature"], body["max_tokens"], body["repeat_penalty"]) == (1.0, 4, 1.0)
    assert bench_http.parse_args([]).temperature == 0.0


def test_rotation_puts_every_server_first_once_over_as_many_rounds(bench_http):
    servers = ["turbospark", "llama-server", "llama-cpp-python"]
    orders = [bench_http.rotation(servers, r) for r in range(3)]
    assert [o[0] for o in orders] == servers
    assert all(sorted(o) == sorted(servers) for o in orders)
    assert bench_http.rotation(servers, 4) == orders[1]
    assert bench_http.rotation([], 2) == []


def test_llama_server_runs_with_our_batch_as_its_slots(tools):
    servers = tools[4]
    args = SimpleNamespace(llama_server="/opt/ls", model="/m.gguf", threads=2, llama_ctx=16384, max_batch=8,
                           deep_context=0)
    server = servers.LlamaServer(args)
    assert server.command() == ["/opt/ls", "-m", "/m.gguf", "-t", "2", "-tb", "2", "-c", "16384", "-np", "8",
                                "--host", "127.0.0.1", "--port", str(server.port)]


def test_llama_cpp_servers_map_a_copy_of_their_own_and_ours_gets_the_speculative_mode(bench_http, tools,
                                                                                     tmp_path):
    import contextlib
    servers = tools[4]
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)))
    args = bench_http.parse_args(["--model", str(model), "--ignore-eos", "--speculative", "off"])
    assert bench_http.sampling_of(args) == {"temperature": 0.0, "ignore_eos": True}
    assert servers.engine_env(args, {})["TURBOSPARK_SPECULATIVE"] == "off"
    assert "TURBOSPARK_SPECULATIVE" not in servers.engine_env(bench_http.parse_args([]), {})   # the server's own
    with contextlib.ExitStack() as stack:
        server = servers.LlamaServer(args)
        assert server.model == str(model)
        server.model = bench_http.own_copy(str(model), stack)
        assert server.model != str(model) and Path(server.model).read_bytes() == model.read_bytes()
        assert server.command()[server.command().index("-m") + 1] == server.model
    assert not Path(server.model).exists() and model.exists()            # the copy goes, the model stays


def test_decode_is_shown_as_weight_bytes_read_and_a_share_of_the_read_bandwidth(report_mod):
    figures = report_mod.decode_bandwidth([20.0, None, 25.0], 600e6, 30.0)
    assert figures["decode_weight_gb_s"] == [pytest.approx(12.0), None, pytest.approx(15.0)]
    assert figures["decode_read_share"] == [pytest.approx(0.4), None, pytest.approx(0.5)]
    assert report_mod.higher_is_better("decode_weight_gb_s") and report_mod.higher_is_better("decode_read_share")
    meta = {"bytes_per_token": 654.5e6, "read_gb_s": {1: 12.25, 2: 18.0}}
    info = report_mod.format_info(report_mod.build_report(meta, {})).splitlines()
    assert info[1] == "weights read a token 654.5 MB; read bandwidth 12.2 GB/s with 1 thread, 18.0 GB/s with 2 threads"


def test_missing_peers_are_skipped_with_a_message(bench_http, capsys, tmp_path):
    args = bench_http.parse_args(["--llama-server", str(tmp_path / "none"), "--llama-python", str(tmp_path / "py")])
    assert [s.name for s in bench_http.servers_to_run(args)] == ["turbospark"]
    err = capsys.readouterr().err
    assert "llama-server skipped" in err and "llama-cpp-python skipped" in err


def test_engine_only_is_compared_with_the_http_figure_of_the_same_round(bench_http):
    class Worker:
        def run(self, clients, max_tokens, sampling):
            assert (clients, max_tokens, sampling) == ([["a"], ["b"]], 64, {"temperature": 0.0, "ignore_eos": True})
            return {"aggregate_tok_s": 200.0}

    plan = SimpleNamespace(engine=[[["x"]], [["a"], ["b"]]], sampling={"temperature": 0.0, "ignore_eos": True})
    metrics = bench_http._defaulting(c8_aggregate_tok_s=[90.0, 150.0])
    bench_http.engine_only(Worker(), plan, 1, metrics, 8)
    assert metrics["engine_c8_aggregate_tok_s"] == [200.0]
    assert metrics["c8_http_over_engine"] == [pytest.approx(0.75)]      # 150 / 200, not 90 / 200


def test_first_request_is_compared_with_the_median_warm_one(bench_http):
    metrics = bench_http._defaulting(first_request_s=[3.0], short_latency_s=[0.2, 0.1, 0.3])
    bench_http.first_over_warm(metrics)
    assert metrics["first_over_warm"] == [pytest.approx(15.0)]
    cold_only = bench_http._defaulting(first_request_s=[3.0])
    bench_http.first_over_warm(cold_only)
    assert cold_only["first_over_warm"] == []


def test_cpu_meter_counts_other_processes_not_the_bench(tools):
    servers = tools[4]
    assert servers.cpu_seconds(2 ** 22 + 12345) == 0.0                   # no such process
    meter, everyone = servers.CpuMeter([os.getpid()]), servers.CpuMeter([])
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:                               # this process's own work
        pass
    # NOTE(flaky): other processes may run meanwhile (CI's leftovers, a neighbour): the meter that
    # excludes this process must read this process's 0.3 s less than one that excludes nothing
    assert everyone.others() - meter.others() > 0.3 - 0.05


class FakeEngine:
    """Runs of `n` tokens: one Prefill event, then one Token per next(); records the steps' order."""

    def __init__(self, engine_mod, n):
        self.events, self.n, self.log = engine_mod, n, []

    def encode(self, text, add_bos):
        return [len(text)]

    def generate(self, ids, params):
        for i in range(self.n):
            self.log.append((ids[0], i))
            yield self.events.Token(id=i, text="x")
        yield self.events.Finish(reason="length", completion_tokens=self.n)


def test_engine_only_drives_clients_round_robin_with_a_new_prompt_when_one_finishes(tools):
    from turbospark_wsgi import engine as engine_mod
    drive = tools[3].drive
    fake = FakeEngine(engine_mod, 3)
    clients = [["a", "bbbb"], ["cc"]]
    result = drive(fake, clients, 3, lambda n: n)
    assert (result["tokens"], result["runs"]) == (9, 3)
    assert result["aggregate_tok_s"] == pytest.approx(9 / result["wall_s"])
    assert fake.log[:4] == [(1, 0), (2, 0), (1, 1), (2, 1)]              # both clients' runs alternate
    assert fake.log.index((4, 0)) > fake.log.index((1, 2))               # the next prompt after the first ends
    assert clients == [["a", "bbbb"], ["cc"]]                            # the caller's lists stay as they were
