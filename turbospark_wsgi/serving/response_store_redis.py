"""Stored /v1/responses in Redis (TURBOSPARK_REDIS=redis://host:port/db), shared by every replica
and kept across their restarts: response_store.MemoryResponseStore's interface.

    turbospark:responses:<owner>:<id>   JSON {"body", "history"}: the response and every message of
                                        its conversation, its own turn last; expires after the TTL

NOTE(owner): the owner (a key's digest, "-" for none) is part of the Redis key, so another key's
lookup reads a key that does not exist: the same answer as for an unknown id, at the same cost.
NOTE(history): each entry holds its whole conversation, so a turn is one GET and a response stays
usable after the ones before it expire or are deleted; TURBOSPARK_RESPONSES_STORE_ITEM_BYTES caps it.
NOTE(outage): when Redis cannot be reached, every store and lookup is a 503 naming the store (never
a silent fallback to this process's memory, where the other replicas could not find it); the next
call after Redis is back reconnects.
"""
import json
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..errors import StoreUnavailable

log = logging.getLogger("turbospark.responses")

PREFIX = "turbospark:responses:"
TIMEOUT = 2.0               # s for one Redis call (an entry holds a whole conversation)
CONNECT_TIMEOUT = 0.5       # s to connect


def where(url):
    """host:port/db of a Redis URL (a unix socket's path), without its password."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    db = parts.path.strip("/") or "0"
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}/{db}"


@dataclass(slots=True)
class _Entry:
    body: dict
    messages: list

    def history(self):
        return self.messages


class RedisResponseStore:
    """Responses in Redis for `ttl` seconds (0: until Redis's own eviction), none over `item_bytes`
    of JSON; `size` 0 keeps none (as in memory; otherwise the count is Redis's to bound)."""

    def __init__(self, url, size, item_bytes, ttl, prefix=PREFIX, client=None):
        # NOTE(retry): one immediate retry on a new connection, so the first call after a Redis
        # restart, which finds its pooled connection dead, succeeds; no backoff to wait out.
        self._redis = client or redis.Redis.from_url(url, socket_timeout=TIMEOUT,
                                                     socket_connect_timeout=CONNECT_TIMEOUT, retry=Retry(NoBackoff(), 1))
        self._size, self._item_bytes, self._ttl_ms = size, item_bytes, int(ttl * 1000)
        self._prefix = prefix
        self.name = f"response store (Redis at {where(url)})"
        self._warned = 0.0

    def check(self):
        if self._size:
            self._call(self._redis.ping)

    def put(self, owner, body, messages, parent=None):
        if not self._size:
            return
        history = (parent.history() if parent is not None else []) + list(messages)
        value = json.dumps({"body": body, "history": history}, separators=(",", ":"))
        if len(value) > self._item_bytes:
            # NOTE(circle): the memory store's message, written here: response_store imports this module
            log.info("response %s not stored: %d bytes of JSON with its conversation "
                     "(TURBOSPARK_RESPONSES_STORE_ITEM_BYTES is %d)", body["id"], len(value), self._item_bytes)
            return
        self._call(self._redis.set, self._key(owner, body["id"]), value, px=self._ttl_ms or None)

    def get(self, owner, response_id):
        raw = self._call(self._redis.get, self._key(owner, response_id))
        if raw is None:
            return None
        doc = json.loads(raw)
        return _Entry(doc["body"], doc["history"])

    def delete(self, owner, response_id):
        return self._call(self._redis.delete, self._key(owner, response_id)) == 1

    def _key(self, owner, response_id):
        return f"{self._prefix}{owner or '-'}:{response_id}"

    def _call(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except redis.RedisError as e:
            now = time.monotonic()
            if now - self._warned >= 30:
                self._warned = now
                log.error("the %s cannot be reached: %s", self.name, e)
            raise StoreUnavailable(f"The {self.name} cannot be reached; stored responses are unavailable "
                                   "until it is back. Try again shortly.", retry_after=2) from None
