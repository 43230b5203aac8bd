"""The servers of tools/bench_http.py, each started in its own process group on loopback.

`with server:` starts it, waits until it answers, and always stops it (SIGINT to the group, then
SIGKILL); `launched` is the monotonic time of the start, `startup_s` the time until it answered.
Peak RSS is VmHWM from /proc: gunicorn's worker processes for this server, the process itself for
llama.cpp's `llama-server` and llama-cpp-python's server. `EngineWorker` is this server's engine
alone in a process of its own (tools/bench_engine_batch.py --worker), set up like the server.
"""
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from bench_http_load import post_json

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 240.0
# NOTE(anchor): where tools/build_llama_server.sh puts llama.cpp (--prefix, or TURBOSPARK_LLAMA_PREFIX)
LLAMA_PREFIX = Path(os.environ.get("TURBOSPARK_LLAMA_PREFIX") or REPO / "build" / "llama.cpp")


def llama_binary(name):
    """llama.cpp's program `name` (llama-server, llama-quantize): the build script's under
    TURBOSPARK_LLAMA_PREFIX, then under the checkout's build/llama.cpp, then on PATH; None if none is."""
    for prefix in dict.fromkeys((LLAMA_PREFIX, REPO / "build" / "llama.cpp")):
        if os.access(prefix / "bin" / name, os.X_OK):
            return str(prefix / "bin" / name)
    return shutil.which(name)


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


def cpu_seconds(pid):
    """User + system CPU seconds of a process (all its threads) so far; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_busy_seconds():
    """CPU seconds of all CPUs together since boot that were neither idle nor waiting on I/O."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / CLOCK_TICKS


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used by processes outside the bench (the machine's other users) from its creation to
    `others()`: the machine's busy time less that of `pids` (the bench, its servers and worker)."""

    def __init__(self, pids):
        self.pids = list(pids)
        self._start = self._read()

    def _read(self):
        return machine_busy_seconds(), sum(map(cpu_seconds, self.pids))

    def others(self):
        """-> CPU seconds of the other processes so far (never below 0: ticks are coarse)."""
        (machine0, own0), (machine1, own1) = self._start, self._read()
        return max(0.0, (machine1 - machine0) - (own1 - own0))


class Server:
    name = ""
    ready_path = "/health"
    cwd = REPO          # NOTE(cwd): `python -m` puts it first on sys.path: the code a server imports

    def __init__(self, args):
        self.args = args
        self.model = args.model         # the file it maps: bench_http gives llama.cpp's servers a copy
        self.port = free_port()
        self.proc = None
        self.launched = None
        self.startup_s = None
        self.log = Path(tempfile.mkdtemp(prefix="bench-http-")) / f"{self.name}.log"

    def command(self):
        raise NotImplementedError

    def env(self):
        return dict(os.environ, PYTHONUNBUFFERED="1")

    def __enter__(self):
        started = self.launched = time.monotonic()
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.command(), cwd=self.cwd, env=self.env(), stdout=log,
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

    def pids(self):
        """The server's processes: the one started and its children."""
        return [self.proc.pid, *child_pids(self.proc.pid)] if self.proc else []

    def peak_rss_mib(self):
        sizes = [k for k in map(vm_hwm_kib, self.measured_pids()) if k is not None]
        return max(sizes) / 1024 if sizes else None


def engine_env(args, base, fresh_cache=False):
    """This server's engine settings: threads, batch and queue sizes, speculative decoding where
    args.speculative names it, and with fresh_cache an empty kernel cache (the C kernels' builds and
    numba's cache), so the first load builds them as on a fresh install."""
    threads = str(args.threads)
    env = dict(base, TURBOSPARK_MODEL=args.model, TURBOSPARK_DEVICE="cpu", TURBOSPARK_MAX_BATCH=str(args.max_batch),
               TURBOSPARK_MAX_WAITING="32", OPENBLAS_NUM_THREADS=str(args.blas_threads or threads),
               OMP_NUM_THREADS=threads, NUMBA_NUM_THREADS=threads)
    if getattr(args, "speculative", None):
        env["TURBOSPARK_SPECULATIVE"] = args.speculative
    if fresh_cache:
        env["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-numba-")
    return env


class OurServer(Server):
    """gunicorn with gunicorn.conf.py: one worker, continuous batching of max_batch sequences."""
    name = "turbospark"

    def command(self):
        return [self.args.python, "-m", "gunicorn", "-c", str(REPO / "gunicorn.conf.py"),
                "--no-control-socket", "turbospark_wsgi.wsgi:app"]

    def env(self):
        return dict(engine_env(self.args, super().env(), self.args.fresh_numba_cache), TURBOSPARK_HOST="127.0.0.1",
                    TURBOSPARK_PORT=str(self.port), TURBOSPARK_THREADS="40")

    def measured_pids(self):
        return child_pids(self.proc.pid) or [self.proc.pid]

    def count_tokens(self, text):
        return post_json(self.port, "/tokenize", {"prompt": text})["count"]


class LlamaServer(Server):
    """llama.cpp's C++ `llama-server`: -np parallel slots (this server's max batch), continuous batching."""
    name = "llama-server"

    def command(self):
        threads = str(self.args.threads)
        return [self.args.llama_server, "-m", self.model, "-t", threads, "-tb", threads,
                "-c", str(max(self.args.llama_ctx, self.args.max_batch * (self.args.deep_context + 512))),
                "-np", str(self.args.max_batch),
                "--host", "127.0.0.1", "--port", str(self.port)]

    def count_tokens(self, text):
        return len(post_json(self.port, "/tokenize", {"content": text})["tokens"])


class LlamaCppPythonServer(Server):
    """llama-cpp-python's OpenAI server; requests run one at a time, none interrupts another."""
    name = "llama-cpp-python"
    ready_path = "/v1/models"

    def command(self):
        threads = str(self.args.threads)
        # NOTE(interrupt): interrupt_requests defaults to true there: a new request would cut the
        # running stream short, which is not serving concurrent clients.
        return [self.args.llama_python, "-m", "llama_cpp.server", "--model", self.model,
                "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "4096",
                "--host", "127.0.0.1", "--port", str(self.port), "--interrupt_requests", "false"]

    def count_tokens(self, text):
        return post_json(self.port, "/extras/tokenize/count", {"input": text})["count"]


class EngineWorker:
    """This server's engine in-process in a child (tools/bench_engine_batch.py --worker): `run(clients,
    max_tokens, sampling)` -> its result dict. `with worker:` starts it and waits for the model; always stops it."""
    name = "engine-only"

    def __init__(self, args):
        self.args = args
        self.proc = None

    def __enter__(self):
        cmd = [self.args.python, str(REPO / "tools" / "bench_engine_batch.py"), "--worker",
               "--model", self.args.model, "--max-batch", str(self.args.max_batch)]
        # NOTE(cache): the usual numba cache even under --fresh-numba-cache: only the server's start is timed
        env = engine_env(self.args, dict(os.environ, PYTHONUNBUFFERED="1"))
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
        try:
            self._answer()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def run(self, clients, max_tokens, sampling=None):
        """`sampling`: the requests' temperature and ignore_eos ({}: greedy, stopping at EOS)."""
        job = {"clients": clients, "max_tokens": max_tokens, **(sampling or {})}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        result = self._answer()
        if "error" in result:
            raise RuntimeError(f"engine-only run failed: {result['error']}")
        return result

    def _answer(self):
        # NOTE(hang): a blocking read; the run's watchdog stops the worker, which ends the read
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine worker exited with {self.proc.poll()}")
        return json.loads(line)

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.close()         # the worker's loop ends at the end of its input
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            Server.stop(self)

    def pids(self):
        return [self.proc.pid] if self.proc else []

    def peak_rss_mib(self):
        k = vm_hwm_kib(self.proc.pid) if self.proc else None
        return None if k is None else k / 1024
