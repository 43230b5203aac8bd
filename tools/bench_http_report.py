"""Statistics and the side-by-side report of tools/bench_http.py: pure functions, no servers.

A result per server is {"metrics": {name: [one value per repeat]}, "info": {...}}. Metric names
ending in "tok_s" are rates (higher is better); those ending in "_tokens" or "_errors" are counts
(not compared); every other metric is a time or a time ratio (lower is better). Ratios are
ours / theirs of the medians.
"""
import json
import statistics

OURS, THEIRS = "turbospark", "llama.cpp"

LABELS = {
    "prefill_tok_s": "prefill tok/s (512-token prompt, TTFT)",
    "decode_tok_s": "single-stream decode tok/s",
    "chat_ttft1_s": "chat turn 1 TTFT s (~600 tokens)",
    "chat_ttft2_s": "chat turn 2 TTFT s",
    "chat_ttft2_over_1": "chat TTFT turn2 / turn1",
    "overhead_s": "1-token request latency s (median)",
    "prefill_prompt_tokens": "prefill prompt tokens",
    "decode_completion_tokens": "decode completion tokens",
}


def label(name):
    """Human-readable name of a metric; concurrency metrics are c<N>_aggregate_tok_s, c<N>_p50_s, ..."""
    if name in LABELS:
        return LABELS[name]
    level, _, rest = name.partition("_")
    kinds = {"aggregate_tok_s": "aggregate tok/s", "p50_s": "p50 latency s", "p95_s": "p95 latency s",
             "tokens": "completion tokens", "errors": "failed requests"}
    if level.startswith("c") and level[1:].isdigit() and rest in kinds:
        return f"{level[1:]:>2} clients: {kinds[rest]}"
    return name


def higher_is_better(name):
    return name.endswith("tok_s")


def is_count(name):
    """Token and error counts: reported, never compared."""
    return name.endswith(("_tokens", "_errors"))


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
    """The JSON-ready report: meta, per-server summaries and info, and ours/theirs ratios."""
    report = {"meta": meta, "servers": {}, "ratios": {}}
    for name, result in servers.items():
        summaries = {m: dict(values=list(v), **(summarize(v) or {})) for m, v in result["metrics"].items()}
        report["servers"][name] = {"metrics": summaries, "info": result["info"]}
    if OURS in servers and THEIRS in servers:
        for metric in (m for m in metric_names(servers) if not is_count(m)):
            report["ratios"][metric] = ratio(_median(report, OURS, metric), _median(report, THEIRS, metric))
    return report


def _median(report, server, metric):
    return report["servers"][server]["metrics"].get(metric, {}).get("median")


def _fmt(value):
    if value is None:
        return "-"
    return f"{value:.4f}" if abs(value) < 1 else f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"


def _fixed(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def _cell(summary, count=False):
    if not summary or summary.get("median") is None:
        return "-"
    fmt = (lambda v: f"{v:g}") if count else _fmt
    if summary["n"] == 1:
        return fmt(summary["median"])
    return f"{fmt(summary['median'])} ({fmt(summary['min'])}-{fmt(summary['max'])})"


def format_table(report):
    """The medians (min-max) of each server side by side, with ours/theirs and which way is better."""
    servers = list(report["servers"])
    rows = [["metric", *servers, "ours/theirs", "better"]]
    for metric in metric_names({s: report["servers"][s] for s in servers}):
        cells = [_cell(report["servers"][s]["metrics"].get(metric), is_count(metric)) for s in servers]
        r = report["ratios"].get(metric)
        rows.append([label(metric), *cells, "-" if r is None else f"{r:.2f}x",
                     "" if is_count(metric) else "higher" if higher_is_better(metric) else "lower"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def format_info(report):
    """One line per server: peak RSS, load average at start and end, startup time, notes."""
    lines = []
    for name, server in report["servers"].items():
        info = server["info"]
        parts = [f"peak RSS {_fixed(info.get('peak_rss_mib'), 0)} MiB",
                 f"load average {_fixed(info.get('load_start'))} -> {_fixed(info.get('load_end'))}",
                 f"ready in {_fixed(info.get('startup_s'), 1)} s"]
        shown = ("peak_rss_mib", "load_start", "load_end", "startup_s")
        parts += [f"{k}={v}" for k, v in info.items() if k not in shown]
        lines.append(f"{name}: " + "; ".join(parts))
    return "\n".join(lines)


def to_json(report):
    return json.dumps(report, indent=2, sort_keys=False)
