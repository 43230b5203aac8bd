"""The process-wide lock queue: up to `slots` generations run (they share batched decode steps in
the engine), up to `max_waiting` more wait, taking turns between clients (FIFO within a client).
Up to `spare` more may hold at once, each for a client below its fair share of the `slots` (the
engine pauses the sequences of a client above its share, so the newcomer starts at once).
Background tickets (the Batch API's lines) come after every live one: one takes a slot only while
a slot is free and no live request waits, and live requests count no background holder against
their slots (the engine runs live sequences first, see scheduler.Scheduler._batch).

    queue.check_room()                      # Overloaded at once when full (no place taken, no lock)
    ticket = queue.enqueue(cancel, client)  # Overloaded (503 + Retry-After) when the queue is full
    while not ticket.wait(keepalive):       # True: this ticket holds the lock
        if ticket.left: return              # cancelled while queued
        yield keep_alive
    ...                                     # run
    ticket.release()                        # idempotent; wakes the next waiter

Built on `threading.Condition`, created on first use so that under gevent it is made after
monkey-patching (a cooperative lock); tests use real threads.
"""
import contextlib
import threading
import time
import weakref
from collections import deque

from ..errors import Overloaded

_WAITING, _HOLDING, _DONE = "waiting", "holding", "done"
_guard = threading.Lock()   # NOTE(fork): only guards the lazy creation below, never held across a switch


def lazy_condition(holder):
    """`holder._cond`, a threading.Condition made on its first use. NOTE(gevent): made after gevent's
    monkey-patching (never at import), so a gevent worker's is cooperative; the guard is held only
    while one is made."""
    if holder._cond is None:
        with _guard:
            if holder._cond is None:
                holder._cond = threading.Condition()
    return holder._cond
_queues = weakref.WeakSet()     # every LockQueue of this process, for shut_down_all()
SHUTTING_DOWN = "the server is shutting down; retry the request (another replica can serve it)"


def shut_down_all():
    """Graceful shutdown (SIGTERM): every queue refuses new tickets and drops its waiters with a
    503; generations already running keep their slots and finish."""
    for queue in list(_queues):
        queue.shut_down()


class Cancelled(Exception):
    """The request was cancelled while it waited for its turn."""


class Ticket:
    __slots__ = ("_queue", "_state", "_deadline", "enqueued_at", "acquired_at", "client", "turn", "background")

    def __init__(self, queue, deadline, client="", turn=0, background=False):
        self._queue = queue
        self._state = _WAITING
        self._deadline = deadline
        self.enqueued_at = time.monotonic()
        self.acquired_at = None
        self.client = client        # whose request (see enqueue)
        self.turn = turn            # the client's tickets ahead of this one when it came
        self.background = background    # a batch line: below every live request

    @property
    def holding(self):
        return self._state == _HOLDING

    @property
    def left(self):
        """True once the ticket is released (cancelled while queued, or finished)."""
        return self._state == _DONE

    def wait(self, timeout=None):
        """Waits up to `timeout` s for the lock. True: held. False: not yet, or `left`.

        Raises Overloaded (and leaves the queue) when the queue's wait timeout has passed.
        """
        return self._queue._wait(self, timeout)

    def release(self):
        """Leaves the queue or gives up the lock; idempotent."""
        self._queue._release(self)

    def abandon(self):
        """Leaves the queue if still waiting; a holder keeps the lock until it releases it."""
        self._queue._release(self, only_waiting=True)


class LockQueue:
    """FIFO ticket lock with `slots` holders (and `spare` more for fairness, see `_may_hold`), a
    bound on waiters and an optional wait timeout (0 = none)."""

    def __init__(self, max_waiting=16, timeout=0.0, retry_after=1, slots=1, spare=0):
        self.slots = max(1, int(slots))
        self.spare = max(0, int(spare))
        self.max_waiting = max_waiting
        self.timeout = timeout
        self.retry_after = retry_after
        self._cond = None
        self._holders = []          # tickets holding the lock (granted, maybe not yet woken)
        self._waiting = deque()     # the rest, in their turn order
        self.shutting_down = False
        _queues.add(self)

    # NOTE(readers): every count below is read under the queue's (reentrant) lock: the waiters are a
    # deque, and iterating one while another thread inserts or removes raises RuntimeError, which on
    # the accept loop's early check took a whole gthread worker down under load.
    @property
    def depth(self):
        """Live requests waiting for their turn (not counting the running ones, nor batch lines)."""
        with self._condition():
            return sum(1 for t in self._waiting if not t.background)

    @property
    def running(self):
        """Tickets holding a slot (more than `slots` while spare places serve other clients)."""
        with self._condition():
            return len(self._holders)

    @property
    def background(self):
        """(holding, waiting) batch lines."""
        with self._condition():
            return (sum(1 for t in self._holders if t.background), sum(1 for t in self._waiting if t.background))

    def shut_down(self):
        """Refuses new tickets and wakes every waiter, which leaves with Overloaded (503)."""
        with self._condition():
            self.shutting_down = True
            self._cond.notify_all()

    def check_room(self, client=""):
        """Raises what `enqueue(client=client)` would raise now (Overloaded: shutting down, or no place
        left) without taking a place: the cheap first step of admission, before a request costs any work.

        NOTE(race): a place freed a moment later is missed, as it would be by a request sent a moment
        earlier; `enqueue` stays the definitive check. The counts are read under the lock
        (NOTE(readers)), held only while they are counted.
        """
        if self.shutting_down:
            raise _shutting_down(self.retry_after)
        with self._condition():
            if self._full() and not self._may_hold(client):
                raise self._busy()

    def enqueue(self, cancel=None, client="", background=False):
        """A new ticket for `client`; Overloaded when `max_waiting` are already waiting.

        NOTE(fair): waiters take turns between clients. A ticket's turn is how many tickets its client
        already has in the queue (running or waiting); it waits behind every waiter whose turn is not
        later than its own, so a client with nothing queued goes before the 9th request of a client
        that fills the batch, and each client's own requests stay in order. With one client (or
        none named) this is plain FIFO. A `background` ticket is never refused for a full queue (the
        batch runner bounds its own lines) and has no wait timeout."""
        with self._condition():
            if self.shutting_down:
                raise _shutting_down(self.retry_after)
            if not background and self._full() and not self._may_hold(client):
                raise self._busy()
            deadline = time.monotonic() + self.timeout if self.timeout and not background else None
            turn = sum(1 for t in self._tickets() if t.client == client and t.background == background)
            ticket = Ticket(self, deadline, client, turn, background)
            self._waiting.insert(len(self._waiting) if background else self._place(turn), ticket)
            self._grant()
        if cancel is not None:
            cancel.on_cancel(ticket.abandon)
        return ticket

    @contextlib.contextmanager
    def slot(self, cancel=None, timeout=None, background=False):
        """Holds the lock for the `with` body. Raises Cancelled if `cancel` fires while queued,
        Overloaded if the queue is full or `timeout` (default: the queue's) passes first."""
        ticket = self.enqueue(cancel, background=background)
        if timeout is not None:
            ticket._deadline = time.monotonic() + timeout if timeout else None
        try:
            if not ticket.wait(None):
                raise Cancelled("cancelled while queued")
            yield ticket
        finally:
            ticket.release()

    def _tickets(self):
        yield from self._holders
        yield from self._waiting

    def _place(self, turn):
        """Where among the waiters a live ticket of `turn` goes: after every live waiter not later
        than it, before every background one."""
        place = len(self._waiting)
        while place > 0 and (self._waiting[place - 1].background or self._waiting[place - 1].turn > turn):
            place -= 1
        return place

    def _may_hold(self, client, background=False):
        """Whether a ticket of `client` may take the lock now: a free slot, or a spare place while
        `client` holds less than its fair share of the slots (`slots` / the clients with tickets).

        NOTE(fair-share): waiters take turns, but a client whose streams fill every slot would still
        hold them until one of its generations ends. A spare place lets another client in at once;
        the engine's scheduler then runs each client's share of the batch and pauses the rest of the
        first client's sequences (their K/V kept). One client alone never takes a spare place, so its
        requests run and wait exactly as before."""
        if background:
            return len(self._holders) < self.slots and not any(not t.background for t in self._waiting)
        live = [t for t in self._holders if not t.background]
        held = len(live)
        if held < self.slots:
            return True
        if held >= self.slots + self.spare:
            return False
        clients = {t.client for t in self._tickets() if not t.background} | {client}
        mine = sum(1 for t in live if t.client == client)
        return mine * len(clients) < self.slots

    def _grant(self):
        """Gives the lock to every waiter that may take it, in turn order (none once shutting down)."""
        if self.shutting_down:
            return
        for ticket in list(self._waiting):
            if self._may_hold(ticket.client, ticket.background):
                self._waiting.remove(ticket)
                self._holders.append(ticket)
                ticket._state, ticket.acquired_at = _HOLDING, time.monotonic()

    def _full(self):
        live = sum(1 for t in self._holders if not t.background)
        return live >= self.slots and self.depth >= self.max_waiting

    def _busy(self):
        return Overloaded(f"the server is busy: {self.depth} requests are already waiting",
                          retry_after=self.retry_after)

    def _condition(self):
        return lazy_condition(self)

    def _wait(self, ticket, timeout):
        end = None if timeout is None else time.monotonic() + timeout
        with self._condition():
            while True:
                if ticket._state != _WAITING:
                    return ticket._state == _HOLDING
                if self.shutting_down:
                    self._drop(ticket)
                    raise _shutting_down(self.retry_after)
                now = time.monotonic()
                if ticket._deadline is not None and now >= ticket._deadline:
                    self._drop(ticket)
                    raise Overloaded("timed out waiting for a free slot", retry_after=self.retry_after)
                limits = [x for x in (end, ticket._deadline) if x is not None]
                limit = min(limits) if limits else None
                if limit is not None and now >= limit:
                    return False
                self._cond.wait(None if limit is None else limit - now)

    def _release(self, ticket, only_waiting=False):
        with self._condition():
            if ticket._state == _DONE or (only_waiting and ticket._state != _WAITING):
                return
            self._drop(ticket)

    def _drop(self, ticket):
        ticket._state = _DONE
        for tickets in (self._holders, self._waiting):
            if ticket in tickets:
                tickets.remove(ticket)
        self._grant()
        self._cond.notify_all()


def _shutting_down(retry_after):
    return Overloaded(SHUTTING_DOWN, retry_after=retry_after, code="server_shutting_down")
