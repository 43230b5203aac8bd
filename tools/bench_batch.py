"""The Batch API below live traffic: a live request's time to first token with no batch and with a
batch running, and the batch's lines per minute with and without live requests.

    python tools/bench_batch.py [--model PATH] [--rounds 5] [--live 8] [--gap 0.3] [--window 12]

One server (gunicorn, one worker). Each round: `--live` live chat streams, one after another with
`--gap` s between them (light traffic), on a quiet server (TTFT quiet); then a batch of chat lines
(`--batch-tokens` each, `ignore_eos`) is created and, once it runs, the same live streams again
(TTFT busy, and the batch's lines finished meanwhile: lines/min with live load); then `--window`
s with no live request (lines/min alone); then the batch is cancelled. Speculative decoding is off
everywhere. It prints each round, the medians, TTFT busy / quiet (the target is at most 1.5), the
ISA and the CPU other processes used meanwhile (the load).
"""
import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import openai  # noqa: E402
from bench_guardrails import isa  # noqa: E402
from bench_http_load import stream  # noqa: E402
from bench_http_servers import CpuMeter, OurServer  # noqa: E402

from turbospark_wsgi.pull import default_model_path  # noqa: E402

LIVE = ["Explain in two sentences why the sky is blue, for a child who keeps asking questions.",
        "Give me three ideas for a short weekend trip near the mountains, with one line each.",
        "What should I pack for a rainy day of hiking? Keep it to a short list of items.",
        "Summarise the plot of a detective story in which the butler is innocent after all."]
TOPICS = ["lighthouses", "bread", "markets", "sailing", "gardens", "winter", "trains", "meals", "dogs",
          "mountains", "storms", "beaches", "roads", "libraries", "bees", "rivers"]


class BatchServer(OurServer):
    name = "turbospark-batch"

    def __init__(self, args):
        super().__init__(args)
        self.data = tempfile.mkdtemp(prefix="bench-batch-data-")

    def env(self):
        return dict(super().env(), TURBOSPARK_DATA=self.data, TURBOSPARK_BATCH_CONCURRENCY=str(self.args.concurrency),
                    TURBOSPARK_SPECULATIVE="off")


def live_ttfts(server, args):
    out = []
    for i in range(args.live):
        body = {"messages": [{"role": "user", "content": LIVE[i % len(LIVE)]}], "max_tokens": 8, "temperature": 0,
                "speculative": False}
        s = stream(server.port, "/v1/chat/completions", body)
        if s.error or s.ttft is None:
            raise SystemExit(f"live request failed: {s.error}")
        out.append(s.ttft)
        time.sleep(args.gap)
    return out


def batch_file(args):
    lines = []
    for i in range(args.lines):
        body = {"messages": [{"role": "user", "content": f"Write a long essay about "
                                                 f"{TOPICS[i % len(TOPICS)]} (part {i})."}],
                "max_tokens": args.batch_tokens, "temperature": 0, "ignore_eos": True, "speculative": False}
        lines.append(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return ("\n".join(lines) + "\n").encode()


def completed(oai, batch_id):
    return oai.batches.retrieve(batch_id).request_counts.completed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--live", type=int, default=8)
    p.add_argument("--gap", type=float, default=0.3)
    p.add_argument("--window", type=float, default=12.0)
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--batch-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.blas_threads, args.fresh_numba_cache = 0, False

    rounds = []
    with BatchServer(args) as server:
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=2)
        data = batch_file(args)
        meter = CpuMeter([os.getpid(), *server.pids()])
        wall = time.monotonic()
        live_ttfts(server, argparse.Namespace(**{**vars(args), "live": 2}))       # warm-up
        for r in range(args.rounds):
            quiet = live_ttfts(server, args)
            upload = oai.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
            batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
            while completed(oai, batch.id) < 1:
                time.sleep(0.1)
            start, t0 = completed(oai, batch.id), time.monotonic()
            busy = live_ttfts(server, args)
            with_live = (completed(oai, batch.id) - start) / (time.monotonic() - t0) * 60
            start, t0 = completed(oai, batch.id), time.monotonic()
            time.sleep(args.window)
            alone = (completed(oai, batch.id) - start) / (time.monotonic() - t0) * 60
            oai.batches.cancel(batch.id)
            while oai.batches.retrieve(batch.id).status != "cancelled":
                time.sleep(0.1)
            row = {"ttft_quiet_ms": statistics.median(quiet) * 1e3, "ttft_busy_ms": statistics.median(busy) * 1e3,
                   "lines_per_min_with_live": with_live, "lines_per_min_alone": alone}
            rounds.append(row)
            if not args.json:
                print(f"round {r}: TTFT quiet {row['ttft_quiet_ms']:6.1f} ms, with a batch running "
                      f"{row['ttft_busy_ms']:6.1f} ms; batch {with_live:5.1f} lines/min with live requests, "
                      f"{alone:5.1f} alone", flush=True)
        others = meter.others() / (time.monotonic() - wall)

    def med(key):
        return statistics.median(row[key] for row in rounds)

    out = {"isa": isa(), "model": Path(args.model).name, "rounds": args.rounds, "live_per_round": args.live,
           "gap_s": args.gap, "batch_tokens": args.batch_tokens, "concurrency": args.concurrency,
           "max_batch": args.max_batch, "ttft_quiet_ms": round(med("ttft_quiet_ms"), 1),
           "ttft_busy_ms": round(med("ttft_busy_ms"), 1),
           "ttft_ratio": round(med("ttft_busy_ms") / med("ttft_quiet_ms"), 3),
           "lines_per_min_with_live": round(med("lines_per_min_with_live"), 1),
           "lines_per_min_alone": round(med("lines_per_min_alone"), 1), "other_load_cores": round(others, 2),
           "rounds_detail": rounds}
    if args.json:
        print(json.dumps(out))
        return
    print(f"\n{out['isa']}; {out['model']}; speculative off; {args.rounds} rounds of {args.live} live chat streams "
          f"{args.gap} s apart; batch lines of {args.batch_tokens} tokens, {args.concurrency} at once; other "
          f"processes used {others:.2f} cores meanwhile")
    print(f"median TTFT: quiet {out['ttft_quiet_ms']} ms, with a batch running {out['ttft_busy_ms']} ms: "
          f"ratio {out['ttft_ratio']} (target <= 1.5)")
    print(f"median batch progress: {out['lines_per_min_alone']} lines/min alone, "
          f"{out['lines_per_min_with_live']} lines/min with live requests")


if __name__ == "__main__":
    main()
