"""The Batch API's primitives in Redis (TURBOSPARK_REDIS), so every replica sees every file and
batch, and a batch whose runner died goes on in any replica.

    turbospark:batch:<name>             a blob (a file's bytes, a record's JSON) or an append-only list
                                        of lines (a batch's results)
    turbospark:batch:index:<name>       a sorted set of ids by the time they were added
    turbospark:batch:batch/<id>.lock    a runner's lease: its token, expiring after LEASE_MS unless renewed

NOTE(lease): a runner renews its lease between lines; one that dies (SIGKILL, a lost host) stops
renewing, and another runner takes the batch over within LEASE_MS. Renewal and release check the
token, so a runner that was too slow never cuts another's lease.
NOTE(outage): when Redis cannot be reached, every Batch API call is a 503 naming the store, as the
stored responses' are (response_store_redis.py).
"""
import secrets
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..errors import StoreUnavailable
from .response_store_redis import CONNECT_TIMEOUT, where

PREFIX = "turbospark:batch:"
TIMEOUT = 5.0                # s for one call: a batch file can be tens of MB
LEASE_MS = 30_000
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class RedisBackend:
    def __init__(self, url, prefix=PREFIX, client=None):
        self._redis = client or redis.Redis.from_url(url, socket_timeout=TIMEOUT,
                                                     socket_connect_timeout=CONNECT_TIMEOUT, retry=Retry(NoBackoff(), 1))
        self._prefix = prefix
        self.name = f"batch store (Redis at {where(url)})"

    def check(self):
        self._call(self._redis.ping)

    def put(self, name, data):
        self._call(self._redis.set, self._prefix + name, data)

    def get(self, name):
        return self._call(self._redis.get, self._prefix + name)

    def delete(self, name):
        return self._call(self._redis.delete, self._prefix + name) == 1

    def append(self, name, data):
        self._call(self._redis.rpush, self._prefix + name, data.rstrip(b"\n"))

    def lines(self, name):
        return self._call(self._redis.lrange, self._prefix + name, 0, -1)

    def trim(self, name):
        """Nothing to cut: each line is one RPUSH, whole or not at all."""

    def index(self, name):
        return [i.decode() for i in self._call(self._redis.zrange, f"{self._prefix}index:{name}", 0, -1)]

    def indexed(self, name, item):
        return self._call(self._redis.zscore, f"{self._prefix}index:{name}", item) is not None

    def index_add(self, name, item):
        self._call(self._redis.zadd, f"{self._prefix}index:{name}", {item: time.time()}, nx=True)

    def index_remove(self, name, item):
        self._call(self._redis.zrem, f"{self._prefix}index:{name}", item)

    def lease(self, name):
        token = secrets.token_hex(8)
        if not self._call(self._redis.set, self._prefix + name, token, nx=True, px=LEASE_MS):
            return None
        return _RedisLease(self, self._prefix + name, token)

    def _call(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except redis.RedisError as e:
            raise StoreUnavailable(f"The {self.name} cannot be reached ({type(e).__name__}); the Batch API is "
                                   "unavailable until it is back. Try again shortly.", retry_after=2) from None


class _RedisLease:
    def __init__(self, backend, key, token):
        self._backend, self._key, self._token = backend, key, token

    def renew(self):
        """True while the lease is still this runner's (renewed for another LEASE_MS)."""
        return bool(self._backend._call(self._backend._redis.eval, _RENEW, 1, self._key, self._token, LEASE_MS))

    def release(self):
        try:
            self._backend._call(self._backend._redis.eval, _RELEASE, 1, self._key, self._token)
        except StoreUnavailable:
            pass                # NOTE(lease): it expires on its own
