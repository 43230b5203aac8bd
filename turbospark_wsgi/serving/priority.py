"""Live requests before batch lines: while a live request is on its way to its first token (its
prompt rendered and tokenized, its turn, its prefill), batch lines submit no compute step.

    arrival = live.arrive()      # Service.run, for a live request
    arrival.done()               # its first token (or its end); idempotent
    live.hold_back()             # a batch line, before each step it submits

NOTE(priority): the queue already grants a batch line a slot only when no live request waits, and
the engine leaves batch lines out of every step in which a live prompt prefills; but a line's step
already waiting on the compute thread, and its thread rendering templates beside the live one's,
still came first. PERF(priority): tools/bench_batch.py, SmolLM2-135M, 2 lines at once: live TTFT
with a batch running was 1.93x its quiet value with the queue and scheduler rules alone.
"""
from .queue import lazy_condition

HOLD_MOST = 1.0             # s a batch line waits at most at once (a live request stuck in a long prefill
                            # pauses batch lines in the engine anyway)


class _Arrival:
    __slots__ = ("_owner", "_open")

    def __init__(self, owner):
        self._owner, self._open = owner, True

    def done(self):
        if self._open:
            self._open = False
            self._owner._leave()


class LiveArrivals:
    """How many live requests are between admission and their first token, in this process."""

    def __init__(self):
        self._count = 0
        self._cond = None

    @property
    def arriving(self):
        return self._count

    def arrive(self):
        with self._condition():
            self._count += 1
        return _Arrival(self)

    def _leave(self):
        with self._condition():
            self._count -= 1
            if self._count <= 0:
                self._count = 0
                self._cond.notify_all()

    def hold_back(self, most=HOLD_MOST):
        """Waits (up to `most` s) until no live request is arriving; at once when none is."""
        if not self._count:
            return
        with self._condition():
            self._cond.wait_for(lambda: self._count == 0, timeout=most)

    def _condition(self):
        return lazy_condition(self)


live = LiveArrivals()
HELD = object()             # what a batch line's step gives when a live request came first


def next_unless_live(steps):
    """On the compute thread: the batch line's next event, or HELD (no step run) while a live
    request is arriving."""
    return HELD if live.arriving else next(steps, None)
