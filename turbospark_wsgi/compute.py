"""The compute thread: one native thread per process that runs every engine call.

Under gevent a numpy call on the hub freezes the whole worker, and a patched
`concurrent.futures` pool runs its jobs on greenlets, i.e. on the hub. So the executor is
`gevent.threadpool.ThreadPoolExecutor` when `threading` is monkey-patched, otherwise
`concurrent.futures.ThreadPoolExecutor`. Both return futures whose `result(timeout)` blocks only
the caller and raises the builtin `TimeoutError`.
"""
import os
import sys
import threading

_executor = None
_pid = None
# NOTE(fork): held only for the few microseconds it takes to build the executor, never across a
# cooperative switch, so a lock made before gevent patches (preload_app) cannot deadlock the hub.
_guard = threading.Lock()


def submit(fn, *args, **kwargs):
    """Runs `fn(*args, **kwargs)` on the compute thread; returns its future."""
    return executor().submit(fn, *args, **kwargs)


def run(fn, *args, **kwargs):
    """Runs `fn` on the compute thread and waits for its result (exceptions propagate)."""
    return submit(fn, *args, **kwargs).result()


def executor():
    """The process-wide single-thread executor, created on first use after fork."""
    global _executor, _pid
    if _executor is not None and _pid == os.getpid():
        return _executor
    with _guard:
        if _executor is None or _pid != os.getpid():
            _executor, _pid = _make_executor(), os.getpid()
    return _executor


def gevent_patched():
    if "gevent" not in sys.modules:
        return False
    from gevent import monkey
    return monkey.is_module_patched("threading")


def _make_executor():
    if gevent_patched():
        from gevent.threadpool import ThreadPoolExecutor
        return ThreadPoolExecutor(max_workers=1)
    from concurrent.futures import ThreadPoolExecutor
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="turbospark-compute")
