"""Live requests before batch lines in this process (serving/priority.py): while one is arriving,
batch lines hold back their steps, and a step already queued runs nothing."""
import threading
import time

from turbospark_wsgi.serving.priority import HELD, LiveArrivals, live, next_unless_live


def test_hold_back_waits_for_the_arrivals_and_returns_at_once_without_any():
    arrivals = LiveArrivals()
    started = time.monotonic()
    arrivals.hold_back()
    assert time.monotonic() - started < 0.05
    first, second = arrivals.arrive(), arrivals.arrive()
    threading.Timer(0.05, first.done).start()
    threading.Timer(0.1, second.done).start()
    arrivals.hold_back(most=5)
    assert 0.08 <= time.monotonic() - started < 2 and arrivals.arriving == 0
    second.done()                   # idempotent: never below zero
    assert arrivals.arriving == 0


def test_hold_back_gives_up_after_its_limit():
    arrivals = LiveArrivals()
    arrival = arrivals.arrive()
    started = time.monotonic()
    arrivals.hold_back(most=0.05)
    assert 0.04 <= time.monotonic() - started < 1
    arrival.done()


def test_a_queued_batch_step_runs_nothing_while_a_live_request_arrives():
    steps = iter([1, 2])
    arrival = live.arrive()
    try:
        assert next_unless_live(steps) is HELD
    finally:
        arrival.done()
    assert next_unless_live(steps) == 1 and next_unless_live(steps) == 2 and next_unless_live(steps) is None
