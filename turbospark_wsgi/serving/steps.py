"""The drive loop, in one place. A request's thread never runs the engine: every call into it is
one job on the compute thread (compute.py), which the request's thread waits for with keep-alives
(generation.Pacer). One run goes

    request thread (Generation._run)          compute thread
    steps.start(engine.generate, ids, ...)    Engine.generate: Scheduler.add makes a Sequence
    event = steps.next()   (until Finish)     Engine.drive(seq) -> Scheduler.poll(seq): the events
                                              seq has waiting; when it has none, Scheduler.step():
                                              one prefill chunk + one batched decode step of every
                                              sequence in the batch (Transformer.forward runs the
                                              layer variant chosen at load, engine/layer_variants.py)
    steps.close()                             Scheduler.release(seq): its slot goes back

so a step runs only when some request asks for its next event, and runs for every sequence alive.
"""
from . import compute, priority


class EngineSteps:
    """One engine run (generate or score), driven from a request's thread: `start`, then `next`
    until it gives the Finish (None after the end), then `close`. `start` and `next` are
    generators that yield the pacer's keep-alives while the compute thread works and return the
    result. A `background` run (a batch line) takes no step while a live request is arriving
    (priority.py)."""

    def __init__(self, pace, background=False):
        self._pace, self._background, self._events = pace, background, None

    @property
    def started(self):
        return self._events is not None

    def start(self, call, *args, **kwargs):
        """Opens the run: `call(*args, **kwargs)` (Engine.generate or Engine.score) on the compute thread."""
        self._events = yield from self._pace.result(compute.submit(call, *args, **kwargs))

    def next(self):
        """The run's next engine event, None at its end: one compute job, which runs at most one step.

        NOTE(priority): a batch line's job waits while a live request is on its way to its first
        token, and one that was already queued when it came runs no step (the live request's jobs go first)."""
        if not self._background:
            return (yield from self._pace.result(compute.submit(next, self._events, None)))
        while True:
            priority.live.hold_back()
            event = yield from self._pace.result(compute.submit(priority.next_unless_live, self._events))
            if event is not priority.HELD:
                return event

    def close(self):
        """Ends the run on the compute thread (its sequence's slot is free when this returns); idempotent."""
        events, self._events = self._events, None
        if events is not None:
            compute.run(events.close)
