"""Shared fixtures: a fake engine with the real Engine API, and a Service/app built around it.

Importable without torch, numpy or a model file.
"""
import math
import os
import shutil
import socket
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from turbospark_wsgi.config import Config
from turbospark_wsgi.engine import Finish, Prefill, Scores, Token
from turbospark_wsgi.serving.registry import Registry
from turbospark_wsgi.serving.service import Service

BOS, EOS, OFFSET = 1, 2, 3          # token id = byte + OFFSET


class FakeTokenizer:
    """The byte vocabulary of FakeEngine: ids below OFFSET are special (BOS, EOS), the others bytes."""

    bos_token, eos_token = "<s>", "</s>"
    _special = {BOS: bos_token, EOS: eos_token}

    def id_to_piece(self, token_id):
        return self._special.get(token_id) or self.token_bytes(token_id).decode("latin-1") or None

    def is_special(self, token_id):
        return token_id < OFFSET

    def token_bytes(self, token_id):
        return bytes([token_id - OFFSET]) if OFFSET <= token_id < 256 + OFFSET else b""

    def token_text(self, token_id):
        data = self.token_bytes(token_id)
        if self.is_special(token_id) or not data:
            return self.id_to_piece(token_id) or "", data, 0
        return data.decode("utf-8", "backslashreplace"), data, int(not 0x80 <= data[0] < 0xC0)   # one byte each


class FakeEngine:
    """A byte-level stand-in for `Engine` (engine.protocol.TextEngine, every member): replies with
    `reply`, one byte per decode step; scores every prompt token as a uniform model would.

    Knobs: `step_delay` (s per step), `gate` (a threading.Event every step waits for),
    `fail_at` (step index that raises), `prefill_delay` (s per prefill chunk), `prefill_chunks`.
    Records every run in `runs` and flags overlapping generations in `overlaps`.
    """

    kind = "generation"
    capabilities = ("generation",)  # the fake does not embed
    backend = "fake"
    backend_reason = "test double"
    add_bos = True                  # the model's rule for raw text (Engine.add_bos)
    tokenizer = FakeTokenizer()

    def __init__(self, name="fake", reply="Hello world", max_context=64, step_delay=0.0,
                 prefill_delay=0.0, prefill_chunks=1, gate=None, fail_at=None):
        self.name = name
        self.reply = reply
        self.max_context = max_context
        self.config = SimpleNamespace(vocab_size=256 + OFFSET, max_seq_len=max_context)
        self.template = SimpleNamespace(source="")     # tests set a real template's source for the parsers
        self.step_delay, self.prefill_delay, self.prefill_chunks = step_delay, prefill_delay, prefill_chunks
        self.gate, self.fail_at = gate, fail_at
        self.runs, self.overlaps, self.closed, self.grammars = [], 0, 0, []
        self._active = 0

    def encode(self, text, add_bos):
        return ([BOS] if add_bos else []) + [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, ids, skip_special=True):
        return bytes(t - OFFSET for t in ids if t >= OFFSET).decode("utf-8", "replace")

    def render_chat(self, messages, tools=None, add_generation_prompt=True, template_kwargs=None):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, template_kwargs=None):
        return self.encode(self.render_chat(messages, tools, add_generation_prompt, template_kwargs), add_bos=True)

    def compile_grammar(self, grammar):
        """Accepts any spec and constrains nothing (the real engine's grammars are tested on it)."""
        self.grammars.append(grammar)
        return SimpleNamespace(start=lambda: None)

    def thinking_budget(self, budget, prompt_ids, open_tag="<think>", close_tag="</think>", then=None):
        """No constraint of its own: the fake's reply is fixed (the real budget is tested on the engine)."""
        return then

    def score(self, prompt_ids, top=0, should_stop=None, client="", cache_salt="", background=False, adapter=None):
        if not prompt_ids or len(prompt_ids) + 1 > self.max_context:
            raise ValueError("bad prompt length")
        lp, n = -math.log(self.config.vocab_size), len(prompt_ids)
        yield Prefill(done=0, total=n)
        yield Scores([(None, [])])
        if (should_stop or (lambda: False))():
            yield Finish("cancelled", prompt_tokens=n)
            return
        yield Prefill(done=n, total=n)
        yield Scores([(lp, [(t, lp) for t in range(min(top, self.config.vocab_size))])] * (n - 1))
        yield Finish("length", prompt_tokens=n)

    def generate(self, prompt_ids, params, should_stop=None, client="", cache_salt="", background=False,
                 adapter=None, constraint=None, choice=0):
        if not prompt_ids or len(prompt_ids) + 1 > self.max_context:
            raise ValueError("bad prompt length")
        self.runs.append(SimpleNamespace(ids=list(prompt_ids), params=params, client=client, cache_salt=cache_salt,
                                         background=background, constraint=constraint, choice=choice,
                                         thread=threading.current_thread()))
        return self._run(list(prompt_ids), params, should_stop or (lambda: False))

    def _run(self, ids, params, should_stop):
        self._active += 1
        self.overlaps += self._active > 1
        try:
            for chunk in range(1, self.prefill_chunks + 1):
                time.sleep(self.prefill_delay)
                yield Prefill(done=len(ids) * chunk // self.prefill_chunks, total=len(ids))
            out = []
            for i, byte in enumerate(self.reply.encode("utf-8")):
                if should_stop():
                    yield Finish("cancelled", prompt_tokens=len(ids), completion_tokens=len(out))
                    return
                if len(out) >= params.max_new_tokens:
                    break
                self._wait_step(i)
                out.append(byte)
                text = bytes(out).decode("utf-8", "ignore")
                stop = next((s for s in params.stop if s in text), None)
                if stop is not None:
                    yield Finish("stop", stop_string=stop, prompt_tokens=len(ids), completion_tokens=len(out))
                    return
                yield Token(id=byte + OFFSET, text=chr(byte) if byte < 128 else "")
            reason = "length" if len(out) >= params.max_new_tokens else "stop"
            yield Finish(reason, prompt_tokens=len(ids), completion_tokens=len(out))
        finally:
            self._active -= 1
            self.closed += 1

    def _wait_step(self, i):
        if self.gate is not None:
            self.gate.wait(10)
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_at == i:
            raise RuntimeError("internal detail: step exploded")


class Harness:
    """A models dir with fake model files, a fake loader, a real Registry/Service, and apps."""

    def __init__(self, root, **config):
        self.root = root
        for name in ("fake", "other"):
            (root / f"{name}.gguf").write_bytes(b"GGUF")
        self.engines = {}           # model id -> FakeEngine (created on demand)
        self.loads = []
        settings = dict(models_dir=str(root), model="fake", load_default=False, keepalive=0.05, max_batch=1,
                        max_paused=0, data_dir=str(root / "data"))
        settings.update(config)
        self.config = Config(**settings)
        self.registry = Registry(self.config, loader=self.load)
        self.service = Service(self.config, self.registry)

    def engine(self, name="fake", **kw):
        if name not in self.engines or kw:
            self.engines[name] = FakeEngine(name=name, **kw)
        return self.engines[name]

    def load(self, path, options=None, name=None):
        self.loads.append(path)
        if os.path.basename(path).startswith("broken"):
            raise ValueError("unsupported tensor type Q3_XX in blk.0.attn_q.weight")
        return self.engine(name)

    def app(self):
        from turbospark_wsgi.http.app import create_app
        return create_app(self.config, service=self.service)

    def client(self):
        import webtest
        return webtest.TestApp(self.app())


@pytest.fixture
def wait_until():
    """wait_until(predicate, timeout=5.0): polls until predicate() is true, else fails the test."""
    def wait(predicate, timeout=5.0):
        end = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > end:
                raise AssertionError("condition not reached")
            time.sleep(0.005)
    return wait


@pytest.fixture
def harness(tmp_path):
    return Harness(tmp_path)


@pytest.fixture
def make_harness(tmp_path_factory):
    return lambda **config: Harness(tmp_path_factory.mktemp("models"), **config)


@pytest.fixture
def client(harness):
    return harness.client()


class RedisServer:
    """A real redis-server on loopback, in memory only or as config file `conf` says (its port,
    address and directory replaced); stop() and start() again keep its port."""

    def __init__(self, workdir, port=None, conf=None):
        self.binary = shutil.which("redis-server")
        self.dir = workdir
        self.port = port or _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.conf = conf
        self.proc = None

    def start(self, timeout=10.0):
        """Starts it and waits for PING; False when it did not come up."""
        import redis
        first = [str(self.conf)] if self.conf else ["--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen([self.binary, *first, "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client, deadline = redis.Redis.from_url(self.url), time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return True
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    return False
                time.sleep(0.05)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def start_redis(tmp_path_factory):
    """start_redis(conf=None) -> a started RedisServer of its own (skips without redis-server: .ci/run
    installs it); every one is stopped at the end of the session."""
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server absent")
    started = []

    def start(conf=None):
        server = RedisServer(tmp_path_factory.mktemp("redis"), conf=conf)
        started.append(server)
        if not server.start():
            pytest.skip("redis-server did not start")
        return server

    yield start
    from turbospark_wsgi.http.batch_runner import stop_all
    stop_all()                  # NOTE(batch): the tests' Batch API runners stop looking before their Redis goes
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(start_redis):
    """A real redis-server on loopback for the session (skips without one: .ci/run installs it)."""
    return start_redis().url

