"""A stranger's chat template on the real stack (gunicorn gthread and gevent): each hostile template
class is answered with a 4xx in the route's envelope within 2 s, while a stream on another model in
the same worker keeps its pace; a template that fails the load's probe leaves /v1/completions
serving and says why its chat routes are refused, on the load line and in /v1/models."""
import json
import os
import statistics
import threading
import time
from pathlib import Path

import pytest

from gguf_edit import with_metadata
from ops_servers import request as http_request

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STORIES = Path(os.environ.get("TURBOSPARK_TEST_MODELS", Path(__file__).resolve().parents[3] / "shared" / "models")) \
    / "stories260K.gguf"
SMOL = "smollm2-135m-instruct"
CHATML_TAIL = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# One template, hostile when the last message names a class: it passes the load's probe
HOSTILE = {
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "huge-string": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                   "{{ ns.s }}",
    "recursion": "{{ m(0) }}",
    "wide-recursion": "{{ w(40) }}",
    "huge-output": "{% for i in range(100000) %}{% for j in range(100) %}" + "y" * 100 + "{% endfor %}{% endfor %}",
    "internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "environment": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
}
EVIL_TEMPLATE = (
    "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}"
    "{% macro w(n) %}{% if n > 0 %}{{ w(n - 1) }}{{ w(n - 1) }}{% endif %}{% endmacro %}"
    "{% set c = messages[-1]['content'] %}"
    + "".join(("{% if" if i == 0 else "{% elif") + f" c == '{name}' %" + "}" + body
              for i, (name, body) in enumerate(HOSTILE.items()))
    + "{% else %}" + CHATML_TAIL + "{% endif %}")
UNUSABLE_TEMPLATE = HOSTILE["loops"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} absent")
    root = tmp_path_factory.mktemp("hostile-models")
    (root / default_model.name).symlink_to(default_model)
    with_metadata(STORIES, root / "evil.gguf", {"tokenizer.chat_template": EVIL_TEMPLATE})
    with_metadata(STORIES, root / "unusable.gguf", {"tokenizer.chat_template": UNUSABLE_TEMPLATE})
    return root


@pytest.fixture(scope="module", params=["gthread", "gevent"])
def server(request, models, start_gunicorn):
    srv = start_gunicorn(request.param, model=SMOL, models=str(models), max_batch=4, keepalive=1)
    srv.worker_class = request.param
    yield srv
    srv.stop()


def post(server, path, body, timeout=30):
    return http_request(server.port, "POST", path, body, {"Authorization": "Bearer x"}, timeout=timeout)


def chat(server, model, content, route="/v1/chat/completions"):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    started = time.monotonic()
    status, headers, raw = post(server, route, body)
    return status, json.loads(raw), time.monotonic() - started


class Pacer:
    """A long greedy stream on the default model, read on its own thread; `gaps(a, b)` are the
    seconds between its tokens that arrived between monotonic times a and b, `rate(a, b)` their
    number a second."""

    def __init__(self, server, raw_stream):
        body = {"model": SMOL, "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0,
                "stream": True, "ignore_eos": True}
        self.stream = raw_stream(server.url, "/v1/completions", body)
        assert self.stream.status == 200
        self.times, self.done = [], threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        while not self.done.is_set():
            try:
                line = self.stream.next_line()
            except (OSError, ValueError, AttributeError):     # aborted under it by stop()
                break
            if line is None:
                break
            if line.startswith("data: "):
                self.times.append(time.monotonic())

    def wait_tokens(self, n, timeout=60):
        deadline = time.monotonic() + timeout
        while len(self.times) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.times) >= n, "the stream stalled"

    def gaps(self, start, end):
        times = [t for t in self.times if start <= t <= end]
        return [b - a for a, b in zip(times, times[1:])]

    def rate(self, start, end):
        """Tokens a second that arrived between monotonic times start and end."""
        return sum(start <= t <= end for t in self.times) / (end - start)

    def stop(self):
        self.done.set()
        self.stream.abort()
        self.thread.join(10)


def test_each_hostile_template_is_a_4xx_within_2s_while_another_models_stream_keeps_its_pace(server, raw_stream):
    assert chat(server, "evil", "hello")[0] == 200          # loads the model; a fair request renders
    pacer = Pacer(server, raw_stream)
    try:
        pacer.wait_tokens(20)
        quiet_from = time.monotonic()
        pacer.wait_tokens(len(pacer.times) + 60)
        quiet = pacer.rate(quiet_from, time.monotonic())
        hostile_from = time.monotonic()
        answers = {}
        for name in HOSTILE:
            answers[name] = chat(server, "evil", name)
        answers["loops via messages"] = chat(server, "evil", "loops", route="/v1/messages")
        hostile_to = time.monotonic()
        pacer.wait_tokens(len(pacer.times) + 5)          # still streaming afterwards
    finally:
        pacer.stop()
    for name, (status, body, seconds) in answers.items():
        assert 400 <= status < 500 and seconds < 2.0, (name, status, seconds, body)
        error = body["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (name, body)
        if name == "loops via messages":
            assert body["type"] == "error"                # Anthropic's envelope
    assert answers["loops"][1]["error"]["code"] == "chat_template_over_budget"
    assert "model 'evil'" in answers["loops"][1]["error"]["message"]
    during, gaps = pacer.rate(hostile_from, hostile_to), pacer.gaps(hostile_from, hostile_to)
    measured = (f"[{server.worker_class}] stream quiet {quiet:.0f} tok/s; while hostile templates ran "
                f"({hostile_to - hostile_from:.1f} s) {during:.0f} tok/s, longest gap {max(gaps) * 1000:.0f} ms")
    print(measured)
    # NOTE(pace): a render holding the worker would stop the stream for its whole budget (~1 s); one
    # sharing the GIL at the interpreter's 5 ms interval would stretch each step several times over.
    assert len(gaps) >= 10 and max(gaps) < 0.5, measured
    assert during >= quiet / 3, measured
    status, _, _ = http_request(server.port, "GET", "/health", timeout=10)
    assert status == 200


def test_a_template_that_fails_the_probe_leaves_completions_serving(server):
    status, _, raw = post(server, "/v1/completions", {"model": "unusable", "prompt": "Once upon a time",
                                                      "max_tokens": 8, "temperature": 0})
    assert status == 200 and json.loads(raw)["choices"][0]["text"] is not None
    status, body, seconds = chat(server, "unusable", "hello")
    assert status == 400 and seconds < 2.0
    assert body["error"]["code"] == "chat_template_unusable" and body["error"]["param"] == "model"
    assert "/v1/completions" in body["error"]["message"] and "render budget" in body["error"]["message"]
    status, body, _ = chat(server, "unusable", "hello", route="/v1/messages")
    assert status == 400 and body["type"] == "error" and "refused" in body["error"]["message"]
    status, _, raw = http_request(server.port, "GET", "/v1/models", timeout=10)
    listed = {m["id"]: m for m in json.loads(raw)["data"]}
    assert listed["unusable"]["chat_template"]["usable"] is False
    assert "render budget" in listed["unusable"]["chat_template"]["reason"]
    assert listed["evil"]["chat_template"] == {"usable": True}
    assert "chat template was refused" in server.tail(200)
