"""Real servers on loopback: gunicorn (gthread and gevent) with the default model, and nginx in front.

Servers start once per module, with timeouts, and are always killed. Tests skip when the default
model is absent (CI pulls it first) or, for nginx, when the nginx binary is absent.
"""
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops_servers import nginx_conf, request as http_request

REPO = Path(__file__).resolve().parents[2]
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
START_TIMEOUT = 180.0


def models_dir():
    return Path(os.environ.get("TURBOSPARK_MODELS") or "~/.cache/turbospark/models").expanduser()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc, timeout=15.0):
    # NOTE(sigint): quick shutdown for both gunicorn and nginx; SIGTERM would let gunicorn wait
    # out graceful_timeout for streams the tests already left.
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


class Gunicorn:
    """gunicorn started from the repository's gunicorn.conf.py, configured by TURBOSPARK_* vars."""

    def __init__(self, workdir, worker_class, **settings):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(workdir) / f"gunicorn-{worker_class}.log"
        env = dict(os.environ, TURBOSPARK_HOST="127.0.0.1", TURBOSPARK_PORT=str(self.port),
                   TURBOSPARK_WORKER_CLASS=worker_class, TURBOSPARK_MODELS=str(models_dir()),
                   TURBOSPARK_DEVICE="cpu", PYTHONUNBUFFERED="1")
        # NOTE(batching): one running request unless a test asks for more, so queue tests see a queue
        settings.setdefault("max_batch", 1)
        env.update({f"TURBOSPARK_{k.upper()}": str(v) for k, v in settings.items()})
        cmd = [sys.executable, "-m", "gunicorn", "-c", str(REPO / "gunicorn.conf.py"),
               "--no-control-socket", "turbospark_wsgi.wsgi:app"]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_ready(self):
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.proc.returncode}:\n{self.tail()}")
            if http_request(self.port, "GET", "/health", timeout=5)[0] == 200:
                return self
            time.sleep(0.25)
        raise RuntimeError(f"gunicorn not healthy after {START_TIMEOUT:.0f} s:\n{self.tail()}")

    def tail(self, n=40):
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self):
        _stop(self.proc)


def nginx_binary():
    # NOTE(nginx-path): Debian installs nginx in /usr/sbin, which is not on every user's PATH.
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)


class Nginx:
    """nginx in the foreground (`daemon off`), with the README's proxy settings, all files in tmp."""

    def __init__(self, binary, workdir, upstream_port):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prefix = Path(workdir) / "nginx"
        (self.prefix / "logs").mkdir(parents=True, exist_ok=True)
        conf = self.prefix / "nginx.conf"
        conf.write_text(nginx_conf(self.prefix, NGINX_PROXY.format(port=self.port, upstream=upstream_port)))
        self.proc = subprocess.Popen([binary, "-p", str(self.prefix), "-c", str(conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)

    def wait_ready(self):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.proc.stderr.read().decode(errors='replace')}")
            if http_request(self.port, "GET", "/health", timeout=5)[0] == 200:
                return self
            time.sleep(0.1)
        raise RuntimeError("nginx did not answer /health")

    def stop(self):
        _stop(self.proc, timeout=5)


NGINX_PROXY = """
    upstream turbospark {{ server 127.0.0.1:{upstream}; keepalive 16; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://turbospark;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
            gzip off;
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
            client_max_body_size 16m;
        }}
    }}"""


class RawStream:
    """One streaming POST on a raw connection, read line by line with arrival times; abort() leaves."""

    def __init__(self, base_url, path, body, timeout=120.0, headers=None):
        host, port = base_url.rsplit("//", 1)[1].split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        self.started = time.perf_counter()
        self.conn.request("POST", path, body=json.dumps(body),
                          headers={"Content-Type": "application/json", "Authorization": "Bearer x", **(headers or {})})
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.lines = []            # (seconds since start, line without the newline)

    def next_line(self):
        raw = self.resp.readline()
        if not raw:
            return None
        line = raw.decode().rstrip("\r\n")
        self.lines.append((time.perf_counter() - self.started, line))
        return line

    def read_until(self, predicate, limit=2000):
        for _ in range(limit):
            line = self.next_line()
            if line is None or predicate(line):
                return line
        return None

    def data_events(self):
        return [(t, line[6:]) for t, line in self.lines if line.startswith("data: ")]

    def abort(self):
        """Close the client side (FIN) without reading the rest."""
        try:
            if self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.resp.close()
        self.conn.close()


@pytest.fixture(scope="session")
def default_model():
    path = models_dir() / MODEL_FILE
    if not path.is_file():
        pytest.skip(f"default model absent ({path}); run `turbospark pull`")
    return path


@pytest.fixture(scope="module")
def server(default_model, start_gunicorn):
    """A module's gthread server on the default model (modules that need another define their own)."""
    srv = start_gunicorn("gthread", model="smollm2-135m-instruct", keepalive=1)
    yield srv
    srv.stop()


@pytest.fixture
def oai(server):
    """The openai SDK against the module's `server`, without retries."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def raw_stream():
    return RawStream


@pytest.fixture(scope="session")
def start_gunicorn(tmp_path_factory):
    """start_gunicorn(worker_class, **TURBOSPARK_settings) -> a healthy server, killed at session end."""
    started = []

    def start(worker_class, **settings):
        server = Gunicorn(tmp_path_factory.mktemp("gunicorn"), worker_class, **settings)
        started.append(server)
        try:
            return server.wait_ready()
        except RuntimeError:
            server.stop()
            raise

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def start_nginx(tmp_path_factory):
    started = []

    def start(upstream_port):
        binary = nginx_binary()
        if binary is None:
            pytest.skip("nginx binary absent")
        nginx = Nginx(binary, tmp_path_factory.mktemp("nginx"), upstream_port)
        started.append(nginx)
        return nginx.wait_ready()

    yield start
    for nginx in started:
        nginx.stop()
