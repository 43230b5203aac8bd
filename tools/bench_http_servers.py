"""The two servers of tools/bench_http.py, each started in its own process group on loopback.

`with server:` starts it, waits until it answers, and always stops it (SIGINT to the group, then
SIGKILL). Peak RSS is VmHWM from /proc: gunicorn's worker processes for this server, the process
itself for llama-cpp-python's.
"""
import http.client
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from bench_http_load import post_json

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 240.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_status(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def vm_hwm_kib(pid):
    """Peak resident set size of a process in KiB (VmHWM), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def child_pids(pid):
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # NOTE(stat): the command name may hold spaces and parentheses; fields follow the last ')'
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


class Server:
    name = ""
    ready_path = "/health"

    def __init__(self, args):
        self.args = args
        self.port = free_port()
        self.proc = None
        self.startup_s = None
        self.log = Path(tempfile.mkdtemp(prefix="bench-http-")) / f"{self.name}.log"

    def command(self):
        raise NotImplementedError

    def env(self):
        return dict(os.environ, PYTHONUNBUFFERED="1")

    def __enter__(self):
        started = time.monotonic()
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.command(), cwd=REPO, env=self.env(), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def __exit__(self, *exc):
        self.stop()

    def _wait_ready(self, started):
        while time.monotonic() - started < START_TIMEOUT:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if get_status(self.port, self.ready_path) == 200:
                return
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {START_TIMEOUT:.0f} s:\n{self.tail()}")

    def tail(self, n=30):
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        # NOTE(stop): the whole process group, so no worker outlives the run; SIGINT is a quick
        # shutdown for both (SIGTERM would let gunicorn wait for graceful_timeout).
        for sig, wait in ((signal.SIGINT, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def measured_pids(self):
        return [self.proc.pid]

    def peak_rss_mib(self):
        sizes = [k for k in map(vm_hwm_kib, self.measured_pids()) if k is not None]
        return max(sizes) / 1024 if sizes else None


class OurServer(Server):
    """gunicorn with gunicorn.conf.py: one worker, continuous batching of max_batch sequences."""
    name = "turbospark"

    def command(self):
        return [self.args.python, "-m", "gunicorn", "-c", str(REPO / "gunicorn.conf.py"),
                "--no-control-socket", "turbospark_wsgi.wsgi:app"]

    def env(self):
        threads = str(self.args.threads)
        return dict(super().env(), TURBOSPARK_MODEL=self.args.model, TURBOSPARK_DEVICE="cpu",
                    TURBOSPARK_HOST="127.0.0.1", TURBOSPARK_PORT=str(self.port), TURBOSPARK_THREADS="40",
                    TURBOSPARK_MAX_BATCH=str(self.args.max_batch), TURBOSPARK_MAX_WAITING="32",
                    OPENBLAS_NUM_THREADS=str(self.args.blas_threads or threads), OMP_NUM_THREADS=threads,
                    NUMBA_NUM_THREADS=threads)

    def measured_pids(self):
        return child_pids(self.proc.pid) or [self.proc.pid]

    def count_tokens(self, text):
        return post_json(self.port, "/tokenize", {"prompt": text})["count"]


class LlamaCppServer(Server):
    """llama-cpp-python's OpenAI server; requests run one at a time, none interrupts another."""
    name = "llama.cpp"
    ready_path = "/v1/models"

    def command(self):
        threads = str(self.args.threads)
        # NOTE(interrupt): interrupt_requests defaults to true there: a new request would cut the
        # running stream short, which is not serving concurrent clients.
        return [self.args.llama_python, "-m", "llama_cpp.server", "--model", self.args.model,
                "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "4096",
                "--host", "127.0.0.1", "--port", str(self.port), "--interrupt_requests", "false"]

    def count_tokens(self, text):
        return post_json(self.port, "/extras/tokenize/count", {"input": text})["count"]
