"""Stored /v1/responses (for GET, DELETE and `previous_response_id`), behind one interface:

    store = open_store(config)                  # in this process, or in Redis with TURBOSPARK_REDIS
    store.check()                               # StoreUnavailable (503) when it cannot be used now
    store.put(owner, body, messages, parent)    # `messages`: this turn; `parent`: what get() gave
    entry = store.get(owner, response_id)       # None when unknown, expired, deleted or another owner's
    entry.body, entry.history()                 # the response; every message of its conversation
    store.delete(owner, response_id)            # False as for an unknown id

NOTE(owner): each response belongs to the key that created it (middleware.Caller.owner: a digest,
never the key): any other key, or none, finds nothing, exactly as for an id that never existed.
"""
import hmac
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger("turbospark.responses")


def open_store(config):
    """The server's response store: in Redis when `config.redis` is set, else in this process."""
    if config.redis:
        from .response_store_redis import RedisResponseStore
        return RedisResponseStore(config.redis, config.responses_store_size, config.responses_store_item_bytes,
                                  config.responses_store_ttl)
    return MemoryResponseStore(config.responses_store_size, config.responses_store_bytes,
                               config.responses_store_ttl, config.responses_store_item_bytes)


def not_kept(response_id, size, cap, setting):
    log.info("response %s not stored: %d bytes of JSON with its conversation (%s is %d)",
             response_id, size, setting, cap)


@dataclass(slots=True)
class _Turn:
    """One response's messages (its input, then its output), linked to the turns before it."""

    messages: list
    parent: "_Turn | None"
    size: int                   # bytes of JSON of this turn and every turn before it

    def history(self):
        turns, turn = [], self
        while turn is not None:             # NOTE(iterative): conversations may be long
            turns.append(turn.messages)
            turn = turn.parent
        return [m for messages in reversed(turns) for m in messages]


@dataclass(slots=True)
class _Stored:
    owner: str
    body: dict
    turn: _Turn
    expires: float
    size: int

    def history(self):
        return self.turn.history()


class MemoryResponseStore:
    """Finished responses of this worker: at most `size` of them holding at most `max_bytes` of JSON
    (a response counts its whole conversation; one over `item_bytes` is not kept), each for `ttl`
    seconds (0: until pushed out); the oldest go first. Thread-safe."""

    name = "in-process response store"

    def __init__(self, size, max_bytes, ttl, item_bytes=None, clock=time.monotonic):
        self._size, self._max_bytes, self._ttl, self._clock = size, max_bytes, ttl, clock
        self._item_bytes = min(max_bytes, item_bytes or max_bytes)
        self._entries = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def check(self):
        """Always usable."""

    def put(self, owner, body, messages, parent=None):
        """Keeps `body` for `owner`; `messages` is its turn, after `parent` (an entry get() gave)."""
        parent_turn = parent.turn if parent is not None else None
        own = len(json.dumps(messages)) + (parent_turn.size if parent_turn else 0)
        size = own + len(json.dumps(body))
        if not self._size:
            return
        if size > self._item_bytes:
            not_kept(body["id"], size, self._item_bytes, "TURBOSPARK_RESPONSES_STORE_ITEM_BYTES"
                      if self._item_bytes < self._max_bytes else "TURBOSPARK_RESPONSES_STORE_BYTES")
            return
        expires = self._clock() + self._ttl if self._ttl else float("inf")
        with self._lock:
            self._entries[body["id"]] = _Stored(owner, body, _Turn(messages, parent_turn, own), expires, size)
            self._bytes += size
            self._evict()

    def get(self, owner, response_id):
        """The stored entry, or None when unknown, deleted, expired, pushed out or not `owner`'s."""
        with self._lock:
            self._evict()
            entry = self._entries.get(response_id)
        return entry if entry is not None and hmac.compare_digest(entry.owner, owner) else None

    def delete(self, owner, response_id):
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or not hmac.compare_digest(entry.owner, owner):
                return False
            del self._entries[response_id]
            self._bytes -= entry.size
            return True

    def _evict(self):
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires > now and len(self._entries) <= self._size and self._bytes <= self._max_bytes:
                return
            self._bytes -= self._entries.popitem(last=False)[1].size

