"""Statistics and the side-by-side report of tools/bench_http.py: pure functions, no servers.

A result per server is {"metrics": {name: [one value per round]}, "info": {...}}. Metric names
ending in "tok_s", "_gb_s", "_share" or "_over_engine" are rates (higher is better); those ending in
"_tokens", "_errors" or "_cores" are counts and load (not compared); every other metric is a time or a
time ratio (lower is better). Ratios are ours / a peer's of the medians: `ratios` against the anchor (llama.cpp's
`llama-server`), `peer_ratios` against every peer measured.
"""
import json
import statistics

OURS, ANCHOR = "turbospark", "llama-server"

LABELS = {
    "prefill_tok_s": "prefill tok/s (~512-token prompt, max_tokens 1)",
    "decode_tok_s": "single-stream decode tok/s (128 tokens)",
    "decode_weight_gb_s": "the same as weight GB/s read (tok/s x bytes a token)",
    "decode_read_share": "the same as a share of the measured read bandwidth",
    "deep_decode_tok_s": "decode tok/s after a --deep-context prompt (64 tokens)",
    "chat_ttft1_s": "chat turn 1 TTFT s (~600 tokens)",
    "chat_ttft2_s": "chat turn 2 TTFT s",
    "chat_ttft2_over_1": "chat TTFT turn2 / turn1",
    "short_ttft_s": "TTFT s, ~12-token prompt, one client (median)",
    "short_latency_s": "whole request s, same, 8 tokens (median)",
    "prefill_prompt_tokens": "prefill prompt tokens",
    "decode_completion_tokens": "decode completion tokens",
    "ready_s": "cold: launch to /health 200 s",
    "first_request_s": "cold: first request after 200 s",
    "first_answer_s": "cold: launch to first answer s",
    "first_over_warm": "cold: first request / warm one",
    "first_burst_tok_s": "cold: first max-batch burst, aggregate tok/s",
    "others_cpu_cores": "CPU of other processes meanwhile (cores)",
}


def label(name):
    """Human-readable name of a metric; concurrency metrics are c<N>_aggregate_tok_s, c<N>_p50_s, ...,
    engine-only ones engine_c<N>_aggregate_tok_s and c<N>_http_over_engine."""
    if name in LABELS:
        return LABELS[name]
    engine = name.startswith("engine_")
    level, _, rest = name.removeprefix("engine_").partition("_")
    kinds = {"aggregate_tok_s": "aggregate tok/s", "p50_s": "p50 latency s", "p95_s": "p95 latency s",
             "tokens": "completion tokens", "errors": "failed requests", "http_over_engine": "over HTTP / engine-only"}
    if level.startswith("c") and level[1:].isdigit() and rest in kinds:
        return f"{level[1:]:>2} {'streams engine-only' if engine else 'clients'}: {kinds[rest]}"
    return name


def higher_is_better(name):
    return name.endswith(("tok_s", "_gb_s", "_share", "_over_engine"))


def is_count(name):
    """Token and error counts, and the machine's other load: reported, never compared."""
    return name.endswith(("_tokens", "_errors", "_cores"))


def percentile(values, q):
    """The q-th percentile (0..100) with linear interpolation between closest ranks; None if empty."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def decode_rate(token_times, completion_tokens):
    """(completion_tokens - 1) / (last token time - first token time); None below two tokens."""
    if completion_tokens < 2 or len(token_times) < 2:
        return None
    span = token_times[-1] - token_times[0]
    return (completion_tokens - 1) / span if span > 0 else None


def decode_bandwidth(decode_tok_s, bytes_per_token, read_gb_s):
    """Per round: the weight GB/s a decode reads (tok/s x bytes a token) and its share of read_gb_s."""
    gb_s = [None if r is None else r * bytes_per_token / 1e9 for r in decode_tok_s]
    return {"decode_weight_gb_s": gb_s, "decode_read_share": [None if g is None else g / read_gb_s for g in gb_s]}


def summarize(values):
    """{"median", "min", "max", "n"} of the values that are not None; None when there are none."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def ratio(ours, theirs):
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def metric_names(servers):
    """Metric names in first-seen order across the servers' results."""
    names = {}
    for result in servers.values():
        names.update(dict.fromkeys(result["metrics"]))
    return list(names)


def build_report(meta, servers):
    """The JSON-ready report: meta, per-server summaries and info, ours/anchor and ours/peer ratios."""
    report = {"meta": meta, "servers": {}, "ratios": {}, "peer_ratios": {}}
    for name, result in servers.items():
        summaries = {m: dict(values=list(v), **(summarize(v) or {})) for m, v in result["metrics"].items()}
        report["servers"][name] = {"metrics": summaries, "info": result["info"]}
    if OURS in servers:
        for peer in (p for p in servers if p != OURS):
            report["peer_ratios"][peer] = {
                metric: ratio(_median(report, OURS, metric), _median(report, peer, metric))
                for metric in metric_names(servers) if not is_count(metric)}
    report["ratios"] = report["peer_ratios"].get(ANCHOR, {})
    return report


def _median(report, server, metric):
    return report["servers"][server]["metrics"].get(metric, {}).get("median")


def _fmt(value):
    if value is None:
        return "-"
    return f"{value:.4f}" if abs(value) < 1 else f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"


def _fixed(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def _cell(summary):
    if not summary or summary.get("median") is None:
        return "-"

    def fmt(v):
        return str(v) if isinstance(v, int) else _fmt(v)      # counts as counted

    if summary["n"] == 1:
        return fmt(summary["median"])
    return f"{fmt(summary['median'])} ({fmt(summary['min'])}-{fmt(summary['max'])})"


def format_table(report):
    """The medians (min-max) of each server side by side, ours/peer ratios and which way is better."""
    servers = list(report["servers"])
    peers = list(report["peer_ratios"])
    rows = [["metric", *servers, *(f"ours/{p}" for p in peers), "better"]]
    for metric in metric_names({s: report["servers"][s] for s in servers}):
        cells = [_cell(report["servers"][s]["metrics"].get(metric)) for s in servers]
        ratios = [report["peer_ratios"][p].get(metric) for p in peers]
        rows.append([label(metric), *cells, *("-" if r is None else f"{r:.2f}x" for r in ratios),
                     "" if is_count(metric) else "higher" if higher_is_better(metric) else "lower"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def format_info(report):
    """The load average over the run (shared by the servers, measured side by side), then one line
    per server: peak RSS, startup time, notes."""
    meta = report["meta"]
    rounds = ", ".join(_fixed(v) for v in meta.get("load_per_round", ())) or "-"
    lines = [f"load average {_fixed(meta.get('load_start'))} at start; {rounds} at each round; "
             f"{_fixed(meta.get('load_end'))} at end ({meta.get('cpu_count', '?')} CPUs)"]
    if meta.get("bytes_per_token"):
        read = ", ".join(f"{gb:.1f} GB/s with {t} thread{'s' * (int(t) > 1)}"
                         for t, gb in meta.get("read_gb_s", {}).items()) or "not measured"
        lines.append(f"weights read a token {meta['bytes_per_token'] / 1e6:.1f} MB; read bandwidth {read}")
    for name, server in report["servers"].items():
        info = server["info"]
        parts = [f"peak RSS {_fixed(info.get('peak_rss_mib'), 0)} MiB",
                 f"ready in {_fixed(info.get('startup_s'), 1)} s"]
        parts += [f"{k}={v}" for k, v in info.items() if k not in ("peak_rss_mib", "startup_s")]
        lines.append(f"{name}: " + "; ".join(parts))
    return "\n".join(lines)


def to_json(report):
    return json.dumps(report, indent=2, sort_keys=False)
