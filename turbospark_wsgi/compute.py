"""The compute thread: one native thread per process that runs every engine call.

Under gevent a numpy call on the hub freezes the whole worker, and a patched
`concurrent.futures` pool runs its jobs on greenlets, i.e. on the hub. So the executor is
`gevent.threadpool.ThreadPoolExecutor` when `threading` is monkey-patched, otherwise
`concurrent.futures.ThreadPoolExecutor`. Both return futures whose `result(timeout)` blocks only
the caller and raises the builtin `TimeoutError`.

On Linux the compute thread runs at a lower CPU priority than the request threads (nice +5 over
the process's; Config.compute_nice, 0 = unchanged), and so do the OpenMP threads it starts:
the engine keeps every idle cycle, but a request thread that has work (a 503 to send, a health
check, a token to stream) gets a core at once instead of waiting behind the kernels' threads.

Work that may take long but must not hold the compute thread (compiling a client's grammar) runs
`aside`: on a small pool of its own, at a lower priority still, waited for with a limit.
"""
import os
import sys
import threading

ASIDE_THREADS = 2           # NOTE(aside): a job past its caller's limit runs on; at most this many at once
# NOTE(fork): held only for the few microseconds it takes to build the executor, never across a
# cooperative switch, so a lock made before gevent patches (preload_app) cannot deadlock the hub.
_guard = threading.Lock()
# PERF(priority): SmolLM2 decoding 8 streams on 2 shared cores (load ~4), bursts of 184 requests
# refused with 503 (tools/bench_reject.py --rounds 16, three runs each): p99 138-188 ms at +0,
# 96-134 ms at +5; +10 was no better than +5.
DEFAULT_NICE = 5
_nice = DEFAULT_NICE            # set by configure (Config.compute_nice, TURBOSPARK_COMPUTE_NICE)


def configure(nice):
    """The nice increment of the compute thread this process creates next (create_app calls it
    before any engine work, so the thread made after fork takes it)."""
    global _nice
    _nice = int(nice)


def submit(fn, *args, **kwargs):
    """Runs `fn(*args, **kwargs)` on the compute thread; returns its future."""
    return executor().submit(fn, *args, **kwargs)


def run(fn, *args, **kwargs):
    """Runs `fn` on the compute thread and waits for its result (exceptions propagate)."""
    return submit(fn, *args, **kwargs).result()


def aside(fn, *args):
    """Runs `fn(*args)` on the aside pool, below the compute thread's priority; returns its future
    (`result(timeout)` raises the builtin TimeoutError, and the job runs on to its end)."""
    return _aside.get().submit(_niced, fn, *args)


_lowered = set()            # native ids of the aside threads already at their priority


def _niced(fn, *args):
    # NOTE(gevent): a set of native thread ids, not threading.local, which gevent makes per greenlet
    if threading.get_native_id() not in _lowered:
        _lowered.add(threading.get_native_id())
        lower_priority(_nice * 2)
    return fn(*args)


def executor():
    """The process-wide single-thread executor, created on first use after fork."""
    return _compute.get()


class _PerProcess:
    """An executor made by `make` on first use in each process (a forked child makes its own)."""

    def __init__(self, make):
        self._make, self._pool, self._pid = make, None, None

    def get(self):
        if self._pool is None or self._pid != os.getpid():
            with _guard:
                if self._pool is None or self._pid != os.getpid():
                    self._pool, self._pid = self._make(), os.getpid()
        return self._pool


def _make_compute():
    pool = _make_executor()
    # NOTE(priority): the first job, so every engine call runs after it, and the threads OpenMP
    # starts for the kernels (on their first parallel region) inherit the thread's priority.
    pool.submit(lower_priority, _nice)
    return pool


_compute = _PerProcess(_make_compute)
_aside = _PerProcess(lambda: _make_executor(ASIDE_THREADS, "turbospark-aside"))


def gevent_patched():
    if "gevent" not in sys.modules:
        return False
    from gevent import monkey
    return monkey.is_module_patched("threading")


def _make_executor(threads=1, name="turbospark-compute"):
    if gevent_patched():
        from gevent.threadpool import ThreadPoolExecutor
        return ThreadPoolExecutor(max_workers=threads)
    from concurrent.futures import ThreadPoolExecutor
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)


def lower_priority(nice):
    """Adds `nice` to the calling thread's nice value (Linux: priorities are per thread); False
    where that is not possible. Never raises: it only tunes latency."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False        # NOTE(platform): elsewhere PRIO_PROCESS with a thread id names a process
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
        return True
    except (OSError, AttributeError):
        return False
