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

While the request loop answers a burst (a full server's 503s, many connections at once), the compute
thread gives way between two layers of its forward pass (a FrontDoor, engine/yielding.py): up to
50 ms at once, never more than a fifth of its time.

The thread is the process's (one lock queue, one engine per process), so it is the one thing here
made once per process; how it runs comes from the app that starts it, not from module settings:

    compute.start(ComputeSettings.from_config(config), door)   # create_app: nice level, the gate
    compute.run(fn, *args)                                      # anyone: fn on the compute thread
"""
import os
import sys
import threading
import time
from dataclasses import dataclass

from ..config import DEFAULT_NICE
from ..engine import yielding

OFF_HUB_THREADS = 4         # gevent only: templates rendering at once, each within its own time budget
ASIDE_THREADS = 2           # NOTE(aside): a job past its caller's limit runs on; at most this many at once
# NOTE(fork): held only for the few microseconds it takes to build the executor, never across a
# cooperative switch, so a lock made before gevent patches (preload_app) cannot deadlock the hub.
_guard = threading.Lock()


@dataclass(frozen=True, slots=True)
class ComputeSettings:
    """How a compute thread runs: `nice` added to the process's priority (Config.compute_nice,
    TURBOSPARK_COMPUTE_NICE; 0 = unchanged; the aside pool takes twice as much), and whether it
    gives way at its app's FrontDoor (Config.front_door, TURBOSPARK_FRONT_DOOR)."""

    nice: int = DEFAULT_NICE
    give_way: bool = True

    @classmethod
    def from_config(cls, config):
        return cls(int(config.compute_nice), bool(config.front_door))


class FrontDoor:
    """The request loop's claim on the process while it answers a burst.

    The loop calls `claim()` when it writes a full server's 503 and `arrived(n)` when it accepts
    connections; two arrivals within HOLD seconds are a burst, which claims the door while the
    server is refusing (a 503 in the last REFUSING seconds). The compute thread calls the door
    (the engine's yielding gate) between two layers: while a claim is fresh it sleeps, with the GIL
    and its core given up, until the loop has been quiet for HOLD seconds. Its waits come out of a
    budget that fills at SHARE seconds a second up to SAVED seconds: a burst gets up to SAVED of
    the compute thread's time at once, and a flood of requests at most SHARE of it. So a burst is
    answered without a GIL hand-off to the compute thread at every socket call.
    """
    # PERF(front-door): tools/bench_reject.py; see docs/operations.md, "A full server says so at once".
    HOLD = 0.002
    SHARE = 0.2
    SAVED = 0.05
    REFUSING = 1.0

    def __init__(self, clock=time.monotonic, sleep=None, on_wait=None):
        self._clock = clock
        self._sleep = sleep or _native_sleep()
        self._claimed = False
        self._until = 0.0           # the claim ends then, unless renewed
        self._budget = self.SAVED   # seconds the compute thread may still wait
        self._counted = clock()     # the budget is filled up to then
        self._last_arrival = self._last_claim = float("-inf")
        self.waited = 0.0           # seconds the compute thread gave way, in all
        self.on_wait = on_wait      # called with each wait's seconds (the app's metrics)

    def claim(self):
        self._until = self._last_claim = self._clock() + self.HOLD
        self._claimed = True

    def arrived(self, count=1):
        now = self._clock()
        # NOTE(front-door): connections arriving together claim only while the server is refusing
        # (a 503 within REFUSING seconds): a busy server with room keeps its compute thread.
        if (count > 1 or now - self._last_arrival < self.HOLD) and now - self._last_claim < self.REFUSING:
            self._until = now + self.HOLD
            self._claimed = True
        self._last_arrival = now

    def __call__(self):
        if not self._claimed:       # PERF(front-door): one attribute read per layer when idle
            return
        now = self._clock()
        if now >= self._until:
            self._claimed = False
            return
        self._budget = min(self.SAVED, self._budget + (now - self._counted) * self.SHARE)
        self._counted = start = now
        end = now + self._budget
        while now < min(self._until, end):
            self._sleep(min(self._until, end) - now)
            now = self._clock()
        waited = now - start
        if waited > 0:
            self._budget -= waited
            self.waited += waited
            if self.on_wait is not None:
                self.on_wait(waited)


def _native_sleep():
    """time.sleep as the OS has it: under gevent the patched one would switch greenlets on a hub
    that the compute thread does not run."""
    if gevent_patched():
        from gevent import monkey
        return monkey.get_original("time", "sleep")
    return time.sleep


def start(settings, door=None):
    """Makes this process's compute thread now: at `settings.nice`, giving way at `door` (a
    FrontDoor) when `settings.give_way`. Returns its executor.

    NOTE(one-thread): the thread belongs to the process, not to an app, and its priority can only
    go down: once made (by an earlier start, or by work submitted before any), it stays as it was
    made and a later start only returns it. A server's worker builds one app, which starts it
    before any engine work."""
    return _compute.get(settings, door)


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
        lower_priority(_compute.made_with[0].nice * 2)
    return fn(*args)


def off_hub(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` where it cannot stall other requests: under gevent on a native thread of
    a small pool (the caller's greenlet waits; the hub runs on), elsewhere in the calling thread,
    which is already one of its own."""
    if not gevent_patched():
        return fn(*args, **kwargs)
    return _off_hub.get().submit(fn, *args, **kwargs).result()


def executor():
    """The process-wide single-thread executor: the one `start` made, else made now (after fork)
    as the last one made in this process was, or at the default priority with no gate."""
    return _compute.get()


class _PerProcess:
    """An executor made by `make(*args)` on first use in each process (a forked child makes its own);
    `made_with` holds the arguments it was last made with, which a make without any reuses."""

    def __init__(self, make, *made_with):
        self._make, self._pool, self._pid = make, None, None
        self.made_with = made_with

    def get(self, *args):
        if self._pool is None or self._pid != os.getpid():
            with _guard:
                if self._pool is None or self._pid != os.getpid():
                    self.made_with = args or self.made_with
                    self._pool, self._pid = self._make(*self.made_with), os.getpid()
        return self._pool


def _make_compute(settings, door):
    pool = _make_executor()
    # NOTE(priority): the first job, so every engine call runs after it, and the threads OpenMP
    # starts for the kernels (on their first parallel region) inherit the thread's priority.
    pool.submit(lower_priority, settings.nice)
    yielding.install(door if settings.give_way else None)
    return pool


_compute = _PerProcess(_make_compute, ComputeSettings(), None)
_aside = _PerProcess(lambda: _make_executor(ASIDE_THREADS, "turbospark-aside"))
_off_hub = _PerProcess(lambda: _make_executor(OFF_HUB_THREADS, "turbospark-off-hub"))


def gevent_patched():
    if "gevent" not in sys.modules:
        return False
    from gevent import monkey
    return monkey.is_module_patched("threading")


def _make_executor(threads=1, name="turbospark-compute"):
    if gevent_patched():
        return _FairGeventExecutor(threads)
    from concurrent.futures import ThreadPoolExecutor
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)


class _FairGeventExecutor:
    """gevent's ThreadPoolExecutor, taken in turn by the greenlets that submit to it.

    NOTE(gevent): the pool lets only as many jobs in as it has threads, behind a semaphore, and a
    greenlet woken by its job's result takes the permit that job freed before the greenlets already
    waiting for it are woken. With one compute thread and 8 streams, 3 streams took every step and 5
    got no token in 12 s (gunicorn gevent, SmolLM2; 8 greenlets on a bare pool: 66, 66, 66, 1, 1, 1,
    1, 1 jobs). Giving the hub one turn before each submit lets the waiters go first: 18-19 each."""

    def __init__(self, threads):
        import gevent
        from gevent.threadpool import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=threads)
        self._yield = gevent.sleep

    def submit(self, fn, *args, **kwargs):
        self._yield(0)
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, *args, **kwargs):
        return self._pool.shutdown(*args, **kwargs)


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
