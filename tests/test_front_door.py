"""compute.FrontDoor: the compute thread gives way to the request loop's bursts, within bounds.
A fake clock: the door's own arithmetic, no timing."""
import os
import subprocess
import sys
import textwrap

import pytest

from turbospark_wsgi.serving import compute
from turbospark_wsgi.engine import yielding

HOLD, SHARE, SAVED = compute.FrontDoor.HOLD, compute.FrontDoor.SHARE, compute.FrontDoor.SAVED


class Clock:
    def __init__(self):
        self.now = 100.0
        self.slept = []
        self.during_sleep = None        # called at each sleep: the loop acting meanwhile

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        assert seconds > 0
        self.slept.append(seconds)
        self.now += seconds
        if self.during_sleep:
            self.during_sleep()


@pytest.fixture
def door():
    clock = Clock()
    d = compute.FrontDoor(clock=clock, sleep=clock.sleep)
    d.clock = clock
    return d


def test_an_idle_door_never_waits(door):
    for _ in range(100):
        door()
    assert door.clock.slept == [] and door.waited == 0


def test_a_claim_makes_the_compute_thread_wait_until_the_loop_is_quiet(door):
    door.claim()
    door.clock.now += HOLD / 4
    door()
    assert sum(door.clock.slept) == pytest.approx(HOLD * 3 / 4)
    door.clock.slept.clear()
    door()                              # the claim has ended
    assert door.clock.slept == []


def test_a_claim_renewed_while_waiting_extends_the_wait_up_to_the_saved_budget(door):
    door.claim()
    door.clock.during_sleep = door.claim    # the loop keeps answering: each sleep ends in a new claim
    door()
    assert door.waited == pytest.approx(SAVED)


def test_a_spent_budget_refills_at_its_share_of_the_time(door):
    door.claim()
    door.clock.during_sleep = door.claim
    door()
    spent = door.waited
    door.clock.now += 0.01                  # all the time since the last wait began earns SHARE
    door.claim()
    door()
    assert door.waited - spent == pytest.approx((spent + 0.01) * SHARE)
    door.clock.now += 100.0                 # a long quiet: the budget is full again, no fuller
    door.claim()
    before = door.waited
    door()
    assert door.waited - before == pytest.approx(SAVED)


def test_under_a_flood_the_compute_thread_keeps_most_of_its_time(door):
    door.clock.during_sleep = door.claim
    start = door.clock.now
    while door.clock.now - start < 10.0:    # the loop claims all the time; a layer takes 1 ms
        door.claim()
        door()
        door.clock.now += 0.001
    assert door.waited / (door.clock.now - start) <= SHARE + SAVED / 10.0 + 1e-9


def test_arrivals_claim_only_in_a_burst_while_the_server_refuses(door):
    door.arrived()
    door.clock.now += HOLD / 2
    door.arrived(3)                         # a burst, but nothing was refused: a busy server with room
    door()
    assert door.waited == 0
    door.claim()                            # a 503
    door.clock.now += HOLD * 10
    door()
    door.arrived()
    door()
    assert door.waited == 0                 # one connection is not a burst
    door.clock.now += HOLD / 2
    door.arrived()                          # a second one close behind: a burst
    door()
    assert door.waited > 0
    waited = door.waited
    door.clock.now += compute.FrontDoor.REFUSING
    door.arrived(3)                         # no 503 for a while: the server has room again
    door()
    assert door.waited == waited


def test_the_compute_thread_waits_at_the_door_it_was_started_with_only_when_it_gives_way():
    code = textwrap.dedent("""
        import os, threading
        from turbospark_wsgi.serving import compute
        from turbospark_wsgi.engine import yielding
        door, other = compute.FrontDoor(), compute.FrontDoor()
        nice = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        base = nice()
        compute.start(compute.ComputeSettings(nice=3, give_way=GIVE), door)
        print(yielding._gate is door, yielding._gate is None, compute.run(nice) - base)
        compute.start(compute.ComputeSettings(nice=0, give_way=True), other)   # one thread: made already
        print(yielding._gate is door, yielding._gate is None, compute.run(nice) - base)
    """)
    for give, gate in ((True, "True False"), (False, "False True")):
        out = subprocess.run([sys.executable, "-c", code.replace("GIVE", str(give))], capture_output=True,
                             text=True, check=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
        lines = [line.rsplit(" ", 1) for line in out.stdout.splitlines()]
        assert [g for g, _ in lines] == [gate, gate]
        if sys.platform.startswith("linux") and os.getpriority(os.PRIO_PROCESS, 0) <= 16:
            assert [n for _, n in lines] == ["3", "3"]      # NOTE(platform): per-thread nice is Linux's
    assert yielding._gate is None or callable(yielding._gate)


def test_a_door_reports_each_wait_to_its_own_hook():
    clock, waits = Clock(), []
    door = compute.FrontDoor(clock=clock, sleep=clock.sleep, on_wait=waits.append)
    door.claim()
    door()
    assert waits == [pytest.approx(HOLD)] and door.waited == pytest.approx(HOLD)
