"""The FIFO lock queue with real threads."""
import threading
import time

import pytest

from turbospark_wsgi.serving.cancel import CancelToken
from turbospark_wsgi.errors import Overloaded
from turbospark_wsgi.serving.queue import Cancelled, LockQueue


def test_tickets_run_in_arrival_order_one_at_a_time(wait_until):
    queue, order, active, overlaps = LockQueue(max_waiting=10), [], [], []
    holder = queue.enqueue()
    assert holder.wait(0)

    def worker(i):
        with queue.slot():
            active.append(i)
            overlaps.append(len(active) > 1)
            order.append(i)
            time.sleep(0.01)
            active.remove(i)

    threads = []
    for i in range(6):
        threads.append(threading.Thread(target=worker, args=(i,)))
        threads[-1].start()
        wait_until(lambda: queue.depth == i + 1)     # enqueued in this order
    holder.release()
    for t in threads:
        t.join(5)
    assert order == list(range(6)) and not any(overlaps)
    assert queue.depth == 0 and queue.running == 0


def test_over_max_waiting_is_503_with_retry_after():
    queue = LockQueue(max_waiting=2, retry_after=3)
    tickets = [queue.enqueue() for _ in range(3)]         # one holder + two waiting
    with pytest.raises(Overloaded) as e:
        queue.enqueue()
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "3"
    tickets[0].release()
    queue.enqueue()                                         # room again


def test_check_room_refuses_exactly_when_enqueue_would_and_takes_no_place():
    queue = LockQueue(max_waiting=2, retry_after=3, slots=2)
    tickets = []
    for _ in range(4):                                      # two running, then two waiting
        queue.check_room()                                  # room: a request that fits is never refused
        tickets.append(queue.enqueue())
    assert (queue.running, queue.depth) == (2, 2)
    with pytest.raises(Overloaded) as e:
        queue.check_room()
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "3"
    assert e.value.code == "server_overloaded" and (queue.running, queue.depth) == (2, 2)
    tickets[2].abandon()                                    # a waiter leaves: room again at once
    queue.check_room()
    queue.enqueue()


def test_check_room_while_shutting_down_is_the_shutdown_503():
    queue = LockQueue(max_waiting=4)
    queue.shut_down()
    with pytest.raises(Overloaded) as e:
        queue.check_room()
    assert e.value.code == "server_shutting_down" and queue.depth == 0


def test_max_waiting_zero_admits_only_the_runner():
    queue = LockQueue(max_waiting=0)
    queue.enqueue()
    with pytest.raises(Overloaded):
        queue.enqueue()


def test_a_cancelled_waiter_leaves_at_once_and_the_order_holds():
    queue = LockQueue()
    holder = queue.enqueue()
    holder.wait(0)
    token = CancelToken()
    leaving = queue.enqueue(token)
    staying = queue.enqueue()
    result = {}

    def wait_leaving():
        start = time.monotonic()
        result["got"] = leaving.wait(None)
        result["took"] = time.monotonic() - start

    t = threading.Thread(target=wait_leaving)
    t.start()
    time.sleep(0.05)
    token.cancel("client disconnected")
    t.join(2)
    assert result["got"] is False and leaving.left and result["took"] < 1
    assert queue.depth == 1
    holder.release()
    assert staying.wait(1)


def test_cancel_does_not_take_the_lock_from_its_holder():
    queue, token = LockQueue(), CancelToken()
    holder = queue.enqueue(token)
    assert holder.wait(0)
    token.cancel()
    assert holder.holding and queue.running == 1
    holder.release()
    assert queue.running == 0


def test_slot_raises_cancelled_for_a_cancelled_waiter():
    queue, token = LockQueue(), CancelToken()
    holder = queue.enqueue()
    holder.wait(0)
    threading.Timer(0.05, token.cancel).start()
    with pytest.raises(Cancelled):
        with queue.slot(token):
            pass
    assert queue.depth == 0


def test_wait_timeout_is_503_and_frees_the_place():
    queue = LockQueue(timeout=0.1)
    holder = queue.enqueue()
    holder.wait(0)
    waiter = queue.enqueue()
    start = time.monotonic()
    with pytest.raises(Overloaded) as e:
        waiter.wait(None)
    assert 0.08 < time.monotonic() - start < 2 and "timed out" in e.value.message
    assert waiter.left and queue.depth == 0


def test_slot_timeout_overrides_the_queue_default():
    queue = LockQueue()
    queue.enqueue().wait(0)
    with pytest.raises(Overloaded):
        with queue.slot(timeout=0.05):
            pass


def test_wait_with_a_short_timeout_returns_false_for_keepalives():
    queue = LockQueue()
    queue.enqueue().wait(0)
    waiter = queue.enqueue()
    assert waiter.wait(0.02) is False and not waiter.left
    assert waiter.wait(0.02) is False


def test_release_is_idempotent():
    queue = LockQueue()
    t = queue.enqueue()
    t.wait(0)
    t.release()
    t.release()
    t.abandon()
    assert queue.running == 0 and queue.enqueue().wait(0)


GEVENT_SCRIPT = r"""
from gevent import monkey; monkey.patch_all()
import threading, time, gevent
from turbospark_wsgi.serving import compute
from turbospark_wsgi.serving.queue import LockQueue

ex = compute.executor()
assert type(ex._pool).__module__.startswith("gevent"), type(ex._pool)
hub_thread = threading.get_native_id()
assert compute.run(threading.get_native_id) != hub_thread       # a real native thread

queue, order, ticks = LockQueue(), [], []
def worker(i):
    with queue.slot():
        order.append(i)
        compute.run(time.sleep, 0.05)       # blocks only this greenlet
def ticker():
    for _ in range(10):
        ticks.append(time.monotonic()); gevent.sleep(0.01)
jobs = [gevent.spawn(ticker)]
for i in range(4):
    jobs.append(gevent.spawn(worker, i)); gevent.sleep(0.001)
gevent.joinall(jobs, timeout=10)
gaps = [b - a for a, b in zip(ticks, ticks[1:])]
assert order == [0, 1, 2, 3], order
assert len(ticks) == 10 and max(gaps) < 0.1, gaps
print("ok")
"""


def test_under_gevent_the_compute_thread_is_native_and_the_queue_cooperative():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", GEVENT_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


GEVENT_FAIR_SCRIPT = r"""
from gevent import monkey; monkey.patch_all()
import time, gevent
from turbospark_wsgi.serving import compute

def job():
    end = time.perf_counter() + 0.002          # a compute step: busy, GIL held
    while time.perf_counter() < end:
        pass
done = [0] * 8
def stream(i):                                  # a stream's greenlet: one step after another
    for _ in range(200):
        compute.run(job)
        done[i] += 1
        if min(done) == 0 and max(done) >= 40:
            break
gevent.joinall([gevent.spawn(stream, i) for i in range(8)], timeout=30)
print(min(done), max(done))
"""


def test_under_gevent_every_greenlet_gets_its_turn_on_the_compute_thread():
    """8 streams stepping through one compute thread: none may starve (gevent's pool let the
    greenlet a result woke take the next turn before those already waiting: 3 took every step)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", GEVENT_FAIR_SCRIPT], capture_output=True, text=True, timeout=90)
    low, high = map(int, out.stdout.split())
    assert low * 2 >= high, f"steps per greenlet ranged from {low} to {high}"


def _holders_in_turn(q, tickets):
    """Releases the running tickets one at a time; the order in which the waiters got a slot."""
    order = []
    waiting = [t for t in tickets if not t.wait(0)]
    while waiting:
        running = [t for t in tickets if t.holding and not t.left]
        running[0].release()
        for t in list(waiting):
            if t.wait(0):
                order.append(t)
                waiting.remove(t)
    return order


def test_waiters_take_turns_between_clients_and_keep_their_own_order():
    q = LockQueue(max_waiting=16, slots=2)
    burst = [q.enqueue(client="a") for _ in range(6)]            # a fills both slots and waits with 4 more
    late = [q.enqueue(client="b"), q.enqueue(client="c"), q.enqueue(client="b")]
    order = _holders_in_turn(q, burst + late)
    names = [("a" if t in burst else "b" if t in (late[0], late[2]) else "c") for t in order]
    assert names == ["b", "c", "b", "a", "a", "a", "a"]         # b's and c's first before a's 3rd..6th
    assert [t for t in order if t in burst] == burst[2:]         # each client's own tickets in order
    assert order.index(late[0]) < order.index(late[2])


def test_one_client_is_plain_fifo():
    q = LockQueue(max_waiting=8, slots=2)
    tickets = [q.enqueue(client="same") for _ in range(7)]
    assert _holders_in_turn(q, tickets) == tickets[2:]
    unnamed = LockQueue(max_waiting=8, slots=1)
    tickets = [unnamed.enqueue() for _ in range(4)]
    assert _holders_in_turn(unnamed, tickets) == tickets[1:]


def _holding(tickets):
    return [t.wait(0) for t in tickets]


def test_a_second_client_takes_a_spare_place_at_once_up_to_its_share():
    q = LockQueue(max_waiting=8, slots=4, spare=4)
    burst = [q.enqueue(client="a") for _ in range(6)]
    assert _holding(burst) == [True] * 4 + [False] * 2          # one client alone: as without spares
    b = [q.enqueue(client="b") for _ in range(3)]
    assert _holding(b) == [True, True, False]                   # half of the 4 slots, at once
    c = [q.enqueue(client="c") for _ in range(3)]
    assert _holding(c) == [True, True, False]                   # a third of the slots, rounded up
    assert (q.running, q.depth) == (8, 4)                       # all 4 + 4 places held
    burst[0].release()                                          # 7 hold, still over the slots: the
    assert not any(_holding(burst[4:] + b[2:] + c[2:]))         # waiters' clients are at or over their share
    for t in burst[1:4] + b[:2]:
        t.release()
    assert _holding(b[2:] + burst[4:]) == [True] * 3            # b and a are below their share again
    assert not c[2].wait(0) and (q.running, q.depth) == (5, 1)  # c holds its 2 of 4 slots among 3 clients


def test_spare_places_take_a_new_client_when_the_waiting_room_is_full():
    q = LockQueue(max_waiting=2, slots=2, spare=2)
    for _ in range(4):
        q.enqueue(client="a")                                   # 2 running, 2 waiting: full for a
    with pytest.raises(Overloaded):
        q.enqueue(client="a")
    assert q.enqueue(client="b").wait(0)                        # b is below its share: a spare place
    with pytest.raises(Overloaded):
        q.enqueue(client="b")                                   # b's share (1 of 2 slots) is taken


def test_without_spare_places_a_new_client_waits_for_a_slot():
    q = LockQueue(max_waiting=8, slots=2)
    [q.enqueue(client="a") for _ in range(2)]
    assert not q.enqueue(client="b").wait(0)


def test_check_room_sees_the_spare_place_of_a_client_below_its_share():
    q = LockQueue(max_waiting=1, slots=1, spare=1)
    q.enqueue(client="a"), q.enqueue(client="a")            # one running, one waiting: full for a
    with pytest.raises(Overloaded):
        q.check_room("a")
    q.check_room("b")
    assert q.enqueue(client="b").wait(0)
    with pytest.raises(Overloaded):
        q.check_room("c")                                   # both places held


# ---- background tickets (Batch API lines) --------------------------------------------------------

def test_a_background_ticket_waits_behind_every_live_one_even_those_that_came_later():
    queue = LockQueue(max_waiting=4, slots=1)
    live = queue.enqueue(client="a")
    assert live.wait(0)
    batch = queue.enqueue(client="a", background=True)
    later = queue.enqueue(client="b")
    assert queue.depth == 1 and queue.background == (0, 1)
    live.release()
    assert later.wait(0) and not batch.wait(0)
    later.release()
    assert batch.wait(0) and queue.background == (1, 0)


def test_a_live_ticket_takes_its_slot_beside_a_background_holder_at_once():
    queue = LockQueue(max_waiting=4, slots=1)
    batch = queue.enqueue(background=True)
    assert batch.wait(0)
    live = queue.enqueue(client="a")
    assert live.wait(0) and queue.running == 2      # the engine runs the live sequence first
    second_batch = queue.enqueue(background=True)
    assert not second_batch.wait(0)                 # no free slot: it waits
    for t in (batch, live, second_batch):
        t.release()


def test_a_full_queue_refuses_live_requests_but_never_a_background_line():
    queue = LockQueue(max_waiting=1, slots=1)
    holder, waiter = queue.enqueue(client="a"), queue.enqueue(client="b")
    with pytest.raises(Overloaded):
        queue.enqueue(client="c")
    batch = queue.enqueue(background=True)
    assert not batch.wait(0) and queue.depth == 1
    for t in (holder, waiter, batch):
        t.release()


def test_counts_read_beside_threads_that_change_the_queue_never_raise():
    """NOTE(readers): the early check (check_room), /health's and /metrics' counts run on other threads
    than the ones that enqueue and leave; iterating the waiters' deque while it changed raised
    RuntimeError, which on gthread's accept loop took the worker down."""
    import sys
    queue = LockQueue(max_waiting=100_000)
    holder = queue.enqueue()
    standing = [queue.enqueue(client=f"c{i % 7}") for i in range(3000)]       # long waits: slow to iterate
    errors, stop = [], threading.Event()

    def churn():
        while not stop.is_set():
            ticket = queue.enqueue(client="churn")
            ticket.abandon()

    def read():
        try:
            while not stop.is_set():
                queue.check_room("reader")
                queue.depth, queue.running, queue.background
        except Exception as e:       # noqa: BLE001 - what the accept loop would have died of
            errors.append(e)
            stop.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=churn) for _ in range(2)] + [threading.Thread(target=read) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        stop.wait(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert errors == []
    for t in standing + [holder]:
        t.release()
    assert queue.depth == 0 and queue.running == 0
