"""Helpers for the operations tests: gunicorn with any WSGI app and settings, its worker's pid and
RSS, /metrics samples, a small HTTP client and nginx with a multi-replica upstream."""
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

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
STORIES = Path(os.environ.get("TURBOSPARK_STORIES", "/work/shared/models/stories260K.gguf"))


def stories_model():
    if not STORIES.is_file():
        pytest.skip(f"stories260K absent ({STORIES})")
    return STORIES


def models_dir_with_stories(directory):
    """A models directory holding only stories260K (id "stories"), so nothing else is listed or loaded."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    link = directory / "stories.gguf"
    if not link.exists():
        link.symlink_to(stories_model())
    return directory


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port, method, path, body=None, headers=None, timeout=60):
    """(status, headers dict with lower-case names, body bytes); (None, {}, b"") if unreachable."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body) if body is not None else None
        conn.request(method, path, body=data, headers=dict({"Content-Type": "application/json"}, **(headers or {})))
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    except OSError:
        return None, {}, b""
    finally:
        conn.close()


def sse_data(body):
    """The `data:` payloads of an SSE body, in order."""
    return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]


class Server:
    """gunicorn on loopback: `app` is a WSGI path, `settings` become TURBOSPARK_* variables."""

    def __init__(self, workdir, app="turbospark_wsgi.wsgi:app", worker_class="gthread", env=None, argv=None,
                 port=None, **settings):
        """`argv`: the command instead of gunicorn with the repository's gunicorn.conf.py; `env`
        goes over every other variable."""
        self.port = port or free_port()
        self.log = Path(workdir) / f"gunicorn-{self.port}.log"
        environ = dict(os.environ, TURBOSPARK_HOST="127.0.0.1", TURBOSPARK_PORT=str(self.port),
                       TURBOSPARK_WORKER_CLASS=worker_class, TURBOSPARK_DEVICE="cpu", PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests" / "integration")]))
        # NOTE(batching): one running request unless a test asks for more, so queue tests see a queue
        settings.setdefault("max_batch", 1)
        environ.update({f"TURBOSPARK_{k.upper()}": str(v) for k, v in settings.items()})
        environ.update(env or {})
        cmd = argv or [sys.executable, "-m", "gunicorn", "-c", str(REPO / "gunicorn.conf.py"),
                       "--no-control-socket", app]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=environ, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_ready(self, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.proc.returncode}:\n{self.tail()}")
            if request(self.port, "GET", "/health", timeout=5)[0] == 200:
                return self
            time.sleep(0.2)
        raise RuntimeError(f"gunicorn not healthy after {timeout} s:\n{self.tail()}")

    def get(self, path, **kw):
        return request(self.port, "GET", path, **kw)

    def post(self, path, body, **kw):
        return request(self.port, "POST", path, body, **kw)

    def worker_pids(self):
        try:
            return sorted(c.pid for c in psutil.Process(self.proc.pid).children())
        except psutil.NoSuchProcess:
            return []

    def worker_rss(self):
        return sum(psutil.Process(pid).memory_info().rss for pid in self.worker_pids())

    def metric(self, name, headers=None, **labels):
        """The sum of the samples of `name` whose labels include `labels`, from /metrics (asked with
        `headers`, e.g. a key)."""
        text = self.get("/metrics", headers=headers)[2].decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def tail(self, n=40):
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def signal(self, sig):
        os.kill(self.proc.pid, sig)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def nginx_binary():
    """nginx's path, or None; Debian installs it in /usr/sbin, which is not on every user's PATH."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)


def replica_conf(template, prefix, port, upstream_ports):
    """tools/nginx/turbospark-replicas.conf made runnable in a temporary prefix."""
    servers = "\n".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;" for p in upstream_ports)
    body = template.read_text()
    start, end = body.index("upstream turbospark {"), body.index("}", body.index("upstream turbospark {"))
    upstream = body[start:end].split("\n")
    kept = [line for line in upstream if line.strip() and not line.strip().startswith(("server ", "#"))]
    body = body[:start] + "\n".join(kept[:1] + [servers] + kept[1:]) + "\n" + body[end:]
    body = body.replace("listen 80;", f"listen 127.0.0.1:{port};")
    return nginx_conf(prefix, body, connections=256)


def nginx_conf(prefix, http_body, connections=64):
    """A runnable nginx.conf with every file under `prefix`: foreground, its own pid, logs and temp
    paths, `http_body` inside the http block."""
    # NOTE(nginx-user): as root, workers would drop to `nobody`, who cannot enter pytest's 0700 tmp.
    user = "user root;" if os.geteuid() == 0 else ""
    return f"""daemon off;
{user}
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections {connections}; }}
http {{
    access_log {prefix}/logs/access.log;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
{http_body}
}}
"""


class ReplicaNginx:
    """Real nginx on a free loopback port with `template` (an nginx config of the repository, its
    upstream `turbospark`) in front of `upstream_ports`; skips the test without nginx."""

    def __init__(self, workdir, template, upstream_ports):
        binary = nginx_binary()
        if binary is None:
            pytest.skip("nginx binary absent")
        self.prefix = Path(workdir) / "nginx"
        (self.prefix / "logs").mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        conf = self.prefix / "nginx.conf"
        conf.write_text(replica_conf(template, self.prefix, self.port, upstream_ports))
        self.proc = subprocess.Popen([binary, "-p", str(self.prefix), "-c", str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 20
        while request(self.port, "GET", "/health", timeout=2)[0] != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.proc.stderr.read().decode()
            time.sleep(0.1)

    def error_log(self, tail=2000):
        return (self.prefix / "logs" / "error.log").read_text()[-tail:]

    def stop(self):
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
