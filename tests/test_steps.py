"""The drive loop (serving/steps.py): a run opens, steps and closes on the compute thread, never
on the request's own thread, and a batch line's queued step runs nothing while a live request arrives."""
import threading

from turbospark_wsgi.serving import compute
from turbospark_wsgi.serving.priority import live
from turbospark_wsgi.serving.steps import EngineSteps


class QuietPace:
    """A pacer that waits without keep-alives (generation.Pacer's `result` contract)."""

    def result(self, fut):
        return fut.result()
        yield           # a generator, as the Pacer's is


class Run:
    """An engine call's events that note which thread each part ran on."""

    def __init__(self, events):
        self.events, self.threads, self.closed = list(events), [], False

    def __call__(self, *args, **kwargs):
        self.threads.append(("open", threading.get_native_id()))
        self.args = args, kwargs
        return self._events()

    def _events(self):
        try:
            for event in self.events:
                self.threads.append(("step", threading.get_native_id()))
                yield event
        finally:
            self.closed = True
            self.threads.append(("close", threading.get_native_id()))


def drive(gen):
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value


def compute_thread():
    return compute.run(threading.get_native_id)


def test_a_run_opens_steps_and_closes_on_the_compute_thread():
    run, steps = Run(["a", "b"]), EngineSteps(QuietPace())
    assert not steps.started
    drive(steps.start(run, [1, 2], should_stop=None))
    assert steps.started and run.args == (([1, 2],), {"should_stop": None})
    assert [drive(steps.next()) for _ in range(3)] == ["a", "b", None]
    steps.close()
    steps.close()                   # idempotent
    assert run.closed and not steps.started
    assert {thread for _, thread in run.threads} == {compute_thread()} != {threading.get_native_id()}


def test_closing_a_run_before_its_end_releases_it_at_once():
    run, steps = Run(["a", "b", "c"]), EngineSteps(QuietPace())
    drive(steps.start(run))
    assert drive(steps.next()) == "a"
    steps.close()
    assert run.closed and [part for part, _ in run.threads] == ["open", "step", "close"]


def test_a_batch_line_steps_only_once_no_live_request_is_arriving():
    run, steps = Run(["a"]), EngineSteps(QuietPace(), background=True)
    drive(steps.start(run))
    arrival = live.arrive()
    threading.Timer(0.05, arrival.done).start()
    assert drive(steps.next()) == "a"       # waits for the arrival, then steps
    assert live.arriving == 0
    steps.close()
