"""The workloads of tools/bench_http.py: stdlib HTTP clients timed on the client side.

Every generation streams over SSE, at temperature 0 unless a workload is given other `sampling`
fields (merged into each request body). A target is any object with `port` and
`count_tokens(text)` (for servers whose streams carry no usage). Times are seconds from sending
the request.
"""
import http.client
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

from bench_http_report import decode_rate, percentile

TIMEOUT = 300.0
SHORT_TOKENS = 8


@dataclass
class Stream:
    """One streamed answer: arrival times of the chunks that carry text, finish and usage."""
    status: int = 0
    token_times: list = field(default_factory=list)
    finish_time: float = None
    finish_reason: str = None
    usage: dict = None
    text: str = ""
    total: float = 0.0
    error: str = None
    headers: dict = field(default_factory=dict)

    def add(self, doc, t):
        """Takes one parsed `data:` event (completion or chat chunk) that arrived at time t."""
        if doc.get("usage"):
            self.usage = doc["usage"]
        for choice in doc.get("choices") or ():
            text = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                self.token_times.append(t)
                self.text += text
            if choice.get("finish_reason") and self.finish_reason is None:
                self.finish_reason, self.finish_time = choice["finish_reason"], t

    @property
    def ttft(self):
        """Time of the first text; of the finish when no chunk carried text (a 1-token answer may not)."""
        return self.token_times[0] if self.token_times else self.finish_time

    def completion_tokens(self):
        # NOTE(count): without usage, one text chunk is one token (llama-cpp-python sends one per
        # token; only a held-back partial UTF-8 character merges two).
        if self.usage and "completion_tokens" in self.usage:
            return self.usage["completion_tokens"]
        return len(self.token_times)


def _post(port, path, body, timeout, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": "Bearer x", **(headers or {})})
    return conn, conn.getresponse()


def post_json(port, path, body, timeout=60.0):
    conn, resp = _post(port, path, body, timeout)
    try:
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"POST {path} -> {resp.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def stream(port, path, body, timeout=TIMEOUT, headers=None):
    """POSTs a streaming request and reads the SSE events to the end; errors are kept, not raised.
    `headers` go beside the default ones; the response's are kept in `out.headers`."""
    out = Stream()
    start = time.perf_counter()
    try:
        conn, resp = _post(port, path, dict(body, stream=True), timeout, headers)
        out.status, out.headers = resp.status, {k.lower(): v for k, v in resp.getheaders()}
        try:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
                return out
            _read_events(resp, out, start)
        finally:
            conn.close()
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.total = time.perf_counter() - start
    return out


def _read_events(resp, out, start):
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("event: error"):
            out.error = "error event"
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        out.add(json.loads(data), time.perf_counter() - start)
    out.error = out.error or "stream ended without [DONE]"


GREEDY = {"temperature": 0}


def completion_body(prompt, max_tokens, sampling=GREEDY):
    # NOTE(sampling): greedy on every server by default; repeat_penalty is llama-cpp-python's (its
    # default is 1.1), which this server ignores as an unknown field.
    return {"prompt": prompt, "max_tokens": max_tokens, "repeat_penalty": 1.0, **sampling,
            "stream_options": {"include_usage": True}}


def chat_body(messages, max_tokens, sampling=GREEDY):
    return {"messages": messages, "max_tokens": max_tokens, "repeat_penalty": 1.0, **sampling,
            "stream_options": {"include_usage": True}}


def _checked(s):
    if s.error or s.ttft is None:
        raise RuntimeError(f"request failed: {s.error or 'no token'}")
    return s


def prefill(target, prompt, sampling=GREEDY):
    """-> (prompt tokens / time to first token, prompt tokens) for a max_tokens=1 completion."""
    s = _checked(stream(target.port, "/v1/completions", completion_body(prompt, 1, sampling)))
    tokens = s.usage["prompt_tokens"] if s.usage else target.count_tokens(prompt)
    return tokens / s.ttft, tokens


def decode(target, prompt, max_tokens, sampling=GREEDY):
    """-> (decode tok/s between the first and the last token, completion tokens)."""
    s = _checked(stream(target.port, "/v1/completions", completion_body(prompt, max_tokens, sampling)))
    n = s.completion_tokens()
    return decode_rate(s.token_times, n), n


def chat_turns(target, system, user1, user2, max_tokens=32, sampling=GREEDY):
    """-> (TTFT of turn 1, TTFT of turn 2), turn 2 repeating turn 1 with its reply and a short question."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user1}]
    first = _checked(stream(target.port, "/v1/chat/completions", chat_body(messages, max_tokens, sampling)))
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": user2}]
    second = _checked(stream(target.port, "/v1/chat/completions", chat_body(messages, max_tokens, sampling)))
    return first.ttft, second.ttft


def short(target, prompt, max_tokens=SHORT_TOKENS, sampling=GREEDY):
    """-> (time to first token, whole request) of one streamed completion of a short prompt."""
    s = _checked(stream(target.port, "/v1/completions", completion_body(prompt, max_tokens, sampling)))
    return s.ttft, s.total


def short_series(target, prompts, max_tokens=SHORT_TOKENS, sampling=GREEDY):
    """-> (median TTFT, median whole request) of short prompts sent one at a time."""
    times = [short(target, p, max_tokens, sampling) for p in prompts]
    return statistics.median(t for t, _ in times), statistics.median(total for _, total in times)


def concurrent(target, client_prompts, max_tokens, sampling=GREEDY):
    """Each client streams its prompts one after another, all clients at once.

    -> {"aggregate_tok_s", "p50_s", "p95_s", "tokens", "errors"}: aggregate = completion tokens of all
    requests / wall time from the first send to the last end; latency = one request's whole stream.
    """
    results, lock = [], threading.Lock()
    barrier = threading.Barrier(len(client_prompts))

    def client(prompts):
        barrier.wait()
        for prompt in prompts:
            started = time.perf_counter()
            s = stream(target.port, "/v1/completions", completion_body(prompt, max_tokens, sampling))
            with lock:
                results.append((started, started + s.total, s))

    threads = [threading.Thread(target=client, args=(p,), daemon=True) for p in client_prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * len(client_prompts[0]) + 10)
    return summarize_concurrent(results)


def summarize_concurrent(results):
    """[(start, end, Stream)] -> aggregate tok/s, p50/p95 latency, tokens and error count."""
    ok = [(a, b, s) for a, b, s in results if not s.error]
    if not ok:
        return {"aggregate_tok_s": None, "p50_s": None, "p95_s": None, "tokens": 0, "errors": len(results)}
    wall = max(b for _, b, _ in results) - min(a for a, _, _ in results)
    tokens = sum(s.completion_tokens() for _, _, s in ok)
    latencies = [b - a for a, b, _ in ok]
    return {"aggregate_tok_s": tokens / wall if wall > 0 else None, "p50_s": percentile(latencies, 50),
            "p95_s": percentile(latencies, 95), "tokens": tokens, "errors": len(results) - len(ok)}
