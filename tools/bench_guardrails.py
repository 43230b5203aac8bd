"""Cost of guardrails on decode: aggregate tok/s of concurrent chat streams with a policy of
100 literal and 20 regex rules (every rule on input and output) against the same server without one.

    python tools/bench_guardrails.py [--model PATH] [--streams 16] [--tokens 128] [--rounds 5]

Two servers (gunicorn, one worker, `--max-batch` rows) run side by side on the same model: one
with TURBOSPARK_GUARDRAILS, one without. Rounds alternate between them (ABAB...), each round
`--streams` clients streaming one chat completion of `--tokens` tokens at once (`ignore_eos`, so
every stream decodes the same count, the rules see real model text and none of them fires). It
prints each round, the medians, the ratio (with rules / without), the machine's ISA and the CPU
that other processes used meanwhile (the load). Then, in this process, the guard's own cost per
token on the text the model wrote (no HTTP), beside the server's step time.
"""
import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_http_load import stream, summarize_concurrent  # noqa: E402
from bench_http_servers import CpuMeter, OurServer  # noqa: E402

from turbospark_wsgi.pull import default_model_path  # noqa: E402

PROMPTS = ["Write a story about a lighthouse keeper.", "Explain how bread rises.", "Describe a busy market.",
           "Tell me about the history of sailing.", "What makes a good garden?", "Describe a winter morning.",
           "Write a letter to a friend abroad.", "How do trains work?", "Describe your favourite meal.",
           "Tell a story about a lost dog.", "What is it like to climb a mountain?", "Describe a thunderstorm.",
           "Write about a day at the beach.", "How are roads built?", "Describe an old library.",
           "Tell me about bees."]
REGEXES = [r"acct-[0-9]{6,10}", r"tok_[a-z0-9]{16,40}", r"sk-live-[a-z0-9]{8,}", r"ghp_[a-z0-9]{20,40}",
           r"xox[abp]-[0-9]{6,12}-[a-z0-9]{8,}", r"order #[0-9]{8}", r"case [a-z]{2}-[0-9]{5}",
           r"ticket [0-9]{3}-[0-9]{4}-[0-9]{2}", r"build [0-9]+\.[0-9]+\.[0-9]+-rc[0-9]", r"badge [a-z]{3}[0-9]{6}",
           r"vault:[a-z]+/[a-z0-9/]{4,60}", r"akia[0-9a-z]{16}", r"pin [0-9]{4} for [a-z]+",
           r"room [0-9]{3}[a-z] at [0-9]{1,2}:[0-9]{2}", r"ref [a-z]{4}-[a-z]{4}-[0-9]{4}",
           r"serial (?:sn|sr)[0-9]{8,12}", r"host [a-z]+-prod-[0-9]{2,3}", r"invoice inv-[0-9]{6}",
           r"project [a-z]+-x[0-9]{2}", r"code (?:red|black)-[0-9]{3}"]


def policy_text(literals=100, seed=0):
    """100 literal rules of made-up two-word codenames and the 20 regex rules, all stage "both"."""
    rnd = random.Random(seed)
    syllables = ["ka", "zu", "mor", "tel", "vin", "qua", "ex", "bro", "lin", "dar", "pho", "gri", "sel", "nox"]
    lines = []
    for i in range(literals):
        word = "".join(rnd.choice(syllables) for _ in range(3)) + " " + "".join(rnd.choice(syllables) for _ in range(2))
        lines += ["[[rules]]", f'id = "lit-{i}"', 'match = "literal"', f'patterns = ["{word}"]',
                  f'action = "{"block" if i % 2 else "redact"}"', ""]
    for i, rx in enumerate(REGEXES):
        lines += ["[[rules]]", f'id = "rx-{i}"', 'match = "regex"', f"patterns = ['{rx}']",
                  f'action = "{"block" if i % 2 else "redact"}"', ""]
    return "\n".join(lines)


class Guarded(OurServer):
    name = "guarded"

    def __init__(self, args, path):
        super().__init__(args)
        self.policy = path

    def env(self):
        return dict(super().env(), TURBOSPARK_GUARDRAILS=str(self.policy))


def round_of(server, args):
    results, lock = [], threading.Lock()
    barrier = threading.Barrier(args.streams)

    def client(i):
        body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": args.tokens,
                "temperature": 0, "ignore_eos": True, "speculative": False, "stream_options": {"include_usage": True}}
        barrier.wait()
        started = time.perf_counter()
        s = stream(server.port, "/v1/chat/completions", body)
        with lock:
            results.append((started, started + s.total, s))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summary = summarize_concurrent(results)
    summary["reasons"] = sorted({s.finish_reason for _, _, s in results})
    summary["texts"] = [s.text for _, _, s in results]
    return summary


def isa():
    flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    base = "AVX-512 VNNI" if "avx512_vnni" in flags else ("AVX-512" if "avx512f" in flags else "AVX2")
    forced = os.environ.get("NUMBA_CPU_NAME")
    return f"{base} machine" + (f", NUMBA_CPU_NAME={forced}" if forced else "") + \
        (f", TURBOSPARK_INT8_ISA={os.environ['TURBOSPARK_INT8_ISA']}" if os.environ.get("TURBOSPARK_INT8_ISA") else "")


def guard_cost(policy, texts):
    """Microseconds the output guard spends per token-sized piece (4 characters) of `texts`."""
    from turbospark_wsgi.serving.guarded import _Choice
    from turbospark_wsgi.serving.guardrails import RuleSet, parse_policy

    rules = RuleSet(parse_policy(policy).rules)
    pieces = 0
    started = time.perf_counter()
    for text in texts:
        choice = _Choice(rules.output)
        chunks = [text[i:i + 4] for i in range(0, len(text), 4)]
        for k, chunk in enumerate(chunks):
            choice.feed(chunk, None, final=k == len(chunks) - 1)
        pieces += len(chunks)
    return (time.perf_counter() - started) / max(1, pieces) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.blas_threads, args.fresh_numba_cache = 0, False

    policy = policy_text()
    path = Path(tempfile.mkdtemp(prefix="bench-guardrails-")) / "guardrails.toml"
    path.write_text(policy)
    plain, guarded = OurServer(args), Guarded(args, path)
    rates = {"none": [], "rules": []}
    texts = []
    with plain, guarded:
        meter = CpuMeter([os.getpid(), *plain.pids(), *guarded.pids()])
        wall = time.monotonic()
        for server in (plain, guarded):             # warm-up: kernels, caches, first requests
            round_of(server, argparse.Namespace(**{**vars(args), "streams": 2, "tokens": 8}))
        for r in range(args.rounds):
            for name, server in (("none", plain), ("rules", guarded)) if r % 2 == 0 else \
                    (("rules", guarded), ("none", plain)):
                result = round_of(server, args)
                if result["errors"] or result["tokens"] != args.streams * args.tokens:
                    raise SystemExit(f"{name}: round {r} incomplete: {result['errors']} errors, "
                                     f"{result['tokens']} tokens, finish {result['reasons']}")
                rates[name].append(result["aggregate_tok_s"])
                texts += result["texts"] if name == "rules" else []
                if not args.json:
                    print(f"round {r} {name:>5}: {result['aggregate_tok_s']:7.1f} tok/s aggregate "
                          f"({args.streams} streams x {args.tokens} tokens, p50 {result['p50_s']:.2f} s)", flush=True)
        others = meter.others() / (time.monotonic() - wall)
    none, rules = statistics.median(rates["none"]), statistics.median(rates["rules"])
    step_us = 1e6 / (none / args.streams) if none else None
    out = {"isa": isa(), "model": Path(args.model).name, "streams": args.streams, "tokens": args.tokens,
           "rounds": args.rounds, "rules": "100 literal + 20 regex, stage both",
           "median_tok_s": {"none": round(none, 1), "rules": round(rules, 1)}, "ratio": round(rules / none, 4),
           "rounds_tok_s": rates, "other_load_cores": round(others, 2),
           "guard_us_per_token": round(guard_cost(policy, texts), 1),
           "stream_step_us": round(step_us) if step_us else None}
    if args.json:
        print(json.dumps(out))
        return
    print(f"\n{out['isa']}; {out['model']}; {args.streams} streams x {args.tokens} tokens, {args.rounds} rounds; "
          f"other processes used {others:.2f} cores meanwhile")
    print(f"median aggregate decode: no rules {none:.1f} tok/s, 100 literal + 20 regex rules {rules:.1f} tok/s: "
          f"ratio {rules / none:.3f}")
    print(f"the output guard alone: {out['guard_us_per_token']} us per token (4 characters) in this process; "
          f"one stream's token comes every {out['stream_step_us']} us")


if __name__ == "__main__":
    main()
