"""What a store of the limits' counters is: the interface that limits.MemoryStore (in this process)
and limits_redis.RedisStore (shared by replicas) both keep, and the Levels they return.

`Limits` (limits.py) picks a store and talks to it only through this interface, so neither backend
imports the other or the module that uses them.
"""
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Levels:
    """A client's counters as admission left them: bucket levels (may be negative for tokens),
    tokens used today, and the wall clock they were read at (unix seconds)."""

    requests: float
    tokens: float
    day_used: int
    now: float


class Store(Protocol):
    flush_every: float          # seconds between charges of completion tokens (0: each as it comes)

    def admit(self, bucket, limit):
        """(reason or None, Levels, lease): takes a request and a concurrency place when no limit
        is over; `reason` names the limit that is ("requests", "tokens", "daily_tokens",
        "concurrency"), and the lease (None when refused) is given back to `settle`."""

    def settle(self, bucket, limit, tokens, requests, lease):
        """Charges `tokens` (and `requests`: -1 gives one back); `lease` ends the generation's place.
        Returns the Levels after it."""
