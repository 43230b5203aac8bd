"""Conversation affinity vs round robin: the TTFT of a chat's 2nd and 3rd turns through nginx in
front of two replicas, against one replica alone.

    python tools/bench_affinity.py [--model GGUF] [--conversations 10] [--turns 3] [--threads 1] [--json]

Two replicas (gunicorn with gunicorn.conf.py, `--threads` compute threads each) run at once, and
deploy/nginx/turbospark.conf in front of them twice: as it is (hash on `x-session-affinity`,
consistent; each conversation sends its own value) and with its `hash` line removed (nginx's
plain round robin). `single` sends the same conversations to one replica directly. Each
conversation is a ~600-token chat (a passage to read, its system prompt numbered so no two
conversations share more than the template's first tokens) followed by short questions, each turn
carrying the whole history, greedy, `--max-tokens` per answer. The turns of all conversations go
one request at a time in one shuffled order (the same in every setup; each conversation's turns in
order), as independent clients would arrive, so round robin sends a next turn to the other replica
about half the time. Every replica keeps `--max-batch` cache slots, more than the conversations,
so no prefix is pushed out by capacity and the routing alone decides. Prints per setup and turn the
median TTFT, its ratio to the first turn's, the prompt tokens served from the cache and how often
a turn landed on the replica of the turn before; and the load average.
"""
import argparse
import contextlib
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_http_load as load  # noqa: E402
from bench_http import CHAT_SYSTEM, CHAT_USER, filler, fit_words  # noqa: E402
from bench_http_servers import OurServer, Server  # noqa: E402
from turbospark_wsgi.pull import default_model_path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NGINX_CONF = REPO / "deploy" / "nginx" / "turbospark.conf"
QUESTIONS = ("Now give the passage a short title.", "Who is the passage about? One sentence.",
             "What is the weather in it?", "Name one sound in it.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--python", default=sys.executable, help="python that runs the replicas' gunicorn")
    p.add_argument("--threads", type=int, default=1, help="compute threads of each replica")
    p.add_argument("--blas-threads", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=16, help="TURBOSPARK_MAX_BATCH: the cache slots kept")
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tokens", type=int, default=600, help="prompt tokens of a first turn")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens of each answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    args.fresh_numba_cache = False
    if not 2 <= args.turns <= len(QUESTIONS) + 1:
        p.error(f"--turns must be 2..{len(QUESTIONS) + 1}")
    return args


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Nginx(Server):
    """deploy/nginx/turbospark.conf in front of `ports`, in the foreground, all its files in a temp
    prefix; `affinity=False` drops its `hash` line (round robin). `with` starts and stops it."""
    name = "nginx"

    def __init__(self, args, ports, affinity):
        super().__init__(args)
        self.binary = shutil.which("nginx") or next(
            (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
        if self.binary is None:
            raise SystemExit("nginx is not installed")
        self.prefix = Path(tempfile.mkdtemp(prefix="bench-affinity-nginx-"))
        (self.prefix / "logs").mkdir()
        body = proxy_conf(NGINX_CONF.read_text(), ports, self.port, affinity)
        user = "user root;" if os.geteuid() == 0 else ""    # workers as nobody could not enter the prefix
        temp = "".join(f"    {kind}_temp_path {self.prefix}/{kind};\n"
                       for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (self.prefix / "nginx.conf").write_text(
            f"daemon off;\n{user}\nworker_processes 1;\npid {self.prefix}/nginx.pid;\n"
            f"error_log {self.prefix}/logs/error.log warn;\nevents {{ worker_connections 256; }}\n"
            f"http {{\n    access_log off;\n{temp}{body}\n}}\n")

    def command(self):
        return [self.binary, "-p", str(self.prefix), "-c", str(self.prefix / "nginx.conf")]


def proxy_conf(text, ports, port, affinity):
    """deploy's nginx config with `ports` as its replicas, listening on loopback `port`; without
    `affinity` its `hash` line is gone, which leaves nginx's round robin."""
    servers = "".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;\n" for p in ports)
    text = re.sub(r"(?m)^    server 127\.0\.0\.1:\d+ .*\n", "", text)
    text = text.replace("    keepalive 32;", servers + "    keepalive 32;")
    if not affinity:
        text = re.sub(r"(?m)^    hash .*\n", "", text)
    return text.replace("listen 80;", f"listen 127.0.0.1:{port};")


def conversations(server, args, setup):
    """[conversation] -> (system, first user message, [follow-up questions]); the first turn ~--tokens;
    the numbers in the system prompts differ per `setup`."""
    numbers = random.Random(args.seed).sample(range(100000, 1000000), args.conversations * 3)
    numbers = numbers[setup * args.conversations:(setup + 1) * args.conversations]
    count = server.count_tokens
    n = fit_words(count, lambda k: CHAT_SYSTEM.format(100000) + CHAT_USER + filler(k), args.tokens - 10)
    return [(CHAT_SYSTEM.format(number), CHAT_USER + filler(n), list(QUESTIONS[:args.turns - 1]))
            for number in numbers]


def schedule(args):
    """The order of the requests: (conversation, turn), shuffled, each conversation's turns in order."""
    slots = [c for c in range(args.conversations) for _ in range(args.turns)]
    random.Random(args.seed + 1).shuffle(slots)
    seen = [0] * args.conversations
    order = []
    for c in slots:
        order.append((c, seen[c]))
        seen[c] += 1
    return order


def run_setup(port, chats, order, args, affinity_header):
    """Every turn of every conversation through `port`; [conversation][turn] -> (ttft, cached, replica)."""
    history = [[{"role": "system", "content": system}, {"role": "user", "content": first}]
               for system, first, _ in chats]
    out = [[None] * args.turns for _ in chats]
    for c, t in order:
        messages = history[c]
        if t:
            messages.append({"role": "user", "content": chats[c][2][t - 1]})
        headers = {"x-session-affinity": f"conversation-{c}"} if affinity_header else None
        s = load.stream(port, "/v1/chat/completions", load.chat_body(messages, args.max_tokens), headers=headers)
        if s.error or s.ttft is None:
            raise RuntimeError(f"conversation {c} turn {t + 1}: {s.error}")
        messages.append({"role": "assistant", "content": s.text})
        cached = ((s.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out[c][t] = (s.ttft, cached, s.headers.get("x-turbospark-replica"))
    return out


def summarize(name, runs, args):
    turns = []
    firsts = [conv[0][0] for conv in runs]
    for t in range(args.turns):
        ttfts = [conv[t][0] for conv in runs]
        same = [conv[t][2] == conv[t - 1][2] for conv in runs] if t else []
        turns.append({"turn": t + 1, "ttft_s": statistics.median(ttfts),
                      "ratio_to_turn_1": statistics.median(conv[t][0] / conv[0][0] for conv in runs),
                      "cached_tokens": statistics.median(conv[t][1] for conv in runs),
                      "same_replica": sum(same) / len(same) if same else None,
                      "ttft_min_s": min(ttfts), "ttft_max_s": max(ttfts)})
    return {"setup": name, "turns": turns, "turn_1_ttft_s": statistics.median(firsts)}


def main(argv=None):
    args = parse_args(argv)
    load_before = os.getloadavg()
    started = time.monotonic()
    with contextlib.ExitStack() as running:
        replicas = [running.enter_context(OurServer(args)) for _ in range(2)]
        log(f"replicas up on {[r.port for r in replicas]}")
        order = schedule(args)
        for r in replicas:          # NOTE(warm-up): compiled kernels and first-request costs, outside the figures
            load.chat_turns(r, "Warm-up.", CHAT_USER + filler(50), QUESTIONS[0], max_tokens=4)
        ports = [r.port for r in replicas]
        proxies = [running.enter_context(Nginx(args, ports, affinity)) for affinity in (False, True)]
        setups = [("single", replicas[0].port, False), ("round robin", proxies[0].port, False),
                  ("affinity", proxies[1].port, True)]
        results = []
        for i, (name, port, header) in enumerate(setups):
            log(f"{name}: {args.conversations} conversations x {args.turns} turns")
            chats = conversations(replicas[0], args, i)     # NOTE(fresh): no setup finds another's cached
            results.append(summarize(name, run_setup(port, chats, order, args, header), args))
    report = {"model": args.model, "threads_per_replica": args.threads, "conversations": args.conversations,
              "turns": args.turns, "first_turn_tokens": args.tokens, "max_tokens": args.max_tokens,
              "load_before": load_before, "load_after": os.getloadavg(), "cpus": os.cpu_count(),
              "seconds": time.monotonic() - started, "setups": results}
    print(json.dumps(report, indent=2) if args.json else format_report(report))


def format_report(report):
    lines = [f"{report['conversations']} conversations x {report['turns']} turns, first turn ~"
             f"{report['first_turn_tokens']} tokens, {report['max_tokens']} tokens per answer; "
             f"{report['threads_per_replica']} thread(s) per replica on {report['cpus']} CPUs; load "
             f"{report['load_before'][0]:.2f} before, {report['load_after'][0]:.2f} after",
             f"{'setup':<12} {'turn':>4} {'TTFT s':>8} {'/ turn 1':>9} {'cached':>7} {'same replica':>13}"]
    for setup in report["setups"]:
        for t in setup["turns"]:
            same = "" if t["same_replica"] is None else f"{t['same_replica']:.0%}"
            lines.append(f"{setup['setup']:<12} {t['turn']:>4} {t['ttft_s']:>8.3f} {t['ratio_to_turn_1']:>9.3f} "
                         f"{t['cached_tokens']:>7.0f} {same:>13}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
