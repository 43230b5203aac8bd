"""The limits' counters in Redis (TURBOSPARK_REDIS=redis://host:port/db), shared by every replica:
a limits_store.Store with the same buckets as limits.MemoryStore, kept by atomic Lua scripts on
Redis's own clock.

Per client (KEY = turbospark:limits:<bucket>):
    KEY:rate        hash {r, t, at}: the request and token buckets and when they were last refilled
                    (ms); it expires when both would be full again, which is the same as absent
    KEY:day:<n>     tokens used on UTC day n; expires after two days
    KEY:leases      sorted set of running generations, scored by when their lease runs out; a
                    replica that dies loses its places within LEASE_MS, the others renew theirs

NOTE(outage): when Redis cannot be reached the request is served unmetered (and logged), never
refused: a limiter outage must not become a server outage.
"""
import logging
import threading
import time
import uuid

import redis

from .limits_store import Levels

log = logging.getLogger("turbospark.limits")

PREFIX = "turbospark:limits:"
LEASE_MS = 30_000
TIMEOUT = 0.5               # s for one Redis call; past it the request goes unmetered

_COMMON = """
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
local rate = KEYS[1] .. ':rate'
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local function refill(level, at, per_minute)
  return math.min(per_minute, level + math.max(now - at, 0) * per_minute / 60000)
end
local s = redis.call('HMGET', rate, 'r', 't', 'at')
local at = tonumber(s[3]) or now
local r = refill(tonumber(s[1]) or rpm, at, rpm)
local t = refill(tonumber(s[2]) or tpm, at, tpm)
local daykey = KEYS[1] .. ':day:' .. math.floor(now / 86400000)
local function save()
  redis.call('HSET', rate, 'r', r, 't', t, 'at', now)
  local full = 1000
  if rpm > 0 then full = math.max(full, (rpm - r) * 60000 / rpm) end
  if tpm > 0 then full = math.max(full, (tpm - t) * 60000 / tpm) end
  redis.call('PEXPIRE', rate, math.ceil(full))
end
"""

# ARGV: rpm, tpm, concurrent, tokens per day, lease id, lease ms -> {reason, r, t, used today, now ms}
_ADMIT = _COMMON + """
local concurrent, quota = tonumber(ARGV[3]), tonumber(ARGV[4])
local leases = KEYS[1] .. ':leases'
local used = tonumber(redis.call('GET', daykey) or '0')
redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
local active = redis.call('ZCARD', leases)
local reason = ''
if rpm > 0 and r < 1 then reason = 'requests'
elseif tpm > 0 and t < 1 then reason = 'tokens'
elseif quota > 0 and used >= quota then reason = 'daily_tokens'
elseif concurrent > 0 and active >= concurrent then reason = 'concurrency' end
if reason == '' then
  if rpm > 0 then r = r - 1 end
  redis.call('ZADD', leases, now + tonumber(ARGV[6]), ARGV[5])
  redis.call('PEXPIRE', leases, tonumber(ARGV[6]))
end
save()
return {reason, tostring(r), tostring(t), used, now}
"""

# ARGV: rpm, tpm, tokens, requests (-1 gives one back), lease id to end ('' none) -> {r, t, used, now ms}
_SETTLE = _COMMON + """
local tokens, requests = tonumber(ARGV[3]), tonumber(ARGV[4])
if tpm > 0 then t = t - tokens end
if requests ~= 0 and rpm > 0 then r = math.min(r - requests, rpm) end
save()
if tokens > 0 then
  redis.call('INCRBY', daykey, tokens)
  redis.call('EXPIRE', daykey, 172800)
end
if ARGV[5] ~= '' then redis.call('ZREM', KEYS[1] .. ':leases', ARGV[5]) end
return {tostring(r), tostring(t), tonumber(redis.call('GET', daykey) or '0'), now}
"""

# KEYS: lease sets, ARGV: [lease ms, member for each key]
_RENEW = """
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
local ms = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', now + ms, ARGV[i + 1])
  redis.call('PEXPIRE', key, ms)
end
return 1
"""


class RedisStore:
    """The counters as a limits_store.Store on Redis; completion tokens are charged once a second."""

    flush_every = 1.0

    def __init__(self, url, prefix=PREFIX, client=None):
        self._redis = client or redis.Redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)
        self._prefix = prefix
        self._admit = self._redis.register_script(_ADMIT)
        self._settle = self._redis.register_script(_SETTLE)
        self._renew = self._redis.register_script(_RENEW)
        self._leases, self._lock = {}, threading.Lock()     # lease id -> its sorted set
        self._renewer = None
        self._warned = 0.0

    def admit(self, bucket, limit):
        lease = uuid.uuid4().hex
        try:
            reason, r, t, used, now = self._admit(keys=[self._prefix + bucket], args=[
                limit.requests_per_minute, limit.tokens_per_minute, limit.concurrent, limit.tokens_per_day,
                lease, LEASE_MS])
        except redis.RedisError as e:
            self._unreachable(e)
            return None, None, None
        levels = Levels(float(r), float(t), int(used), int(now) / 1000)
        if reason:
            return reason.decode(), levels, None
        self._hold(bucket, lease)
        return None, levels, lease

    def settle(self, bucket, limit, tokens, requests, lease):
        if lease is not None:
            with self._lock:
                self._leases.pop(lease, None)
        try:
            r, t, used, now = self._settle(keys=[self._prefix + bucket], args=[
                limit.requests_per_minute, limit.tokens_per_minute, tokens, requests, lease or ""])
        except redis.RedisError as e:
            self._unreachable(e)
            return None
        return Levels(float(r), float(t), int(used), int(now) / 1000)

    def _hold(self, bucket, lease):
        with self._lock:
            self._leases[lease] = self._prefix + bucket + ":leases"
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew_loop, name="turbospark-limits", daemon=True)
                self._renewer.start()

    def _renew_loop(self):
        # NOTE(leases): a generation may wait in the queue or run for longer than a lease; its
        # place is renewed until it ends, and lost within LEASE_MS if this process dies.
        while True:
            time.sleep(LEASE_MS / 3000)
            with self._lock:
                held = list(self._leases.items())
            if not held:
                continue
            try:
                self._renew(keys=[key for _, key in held], args=[LEASE_MS] + [lease for lease, _ in held])
            except redis.RedisError as e:
                self._unreachable(e)

    def _unreachable(self, exc):
        now = time.monotonic()
        if now - self._warned >= 30:
            self._warned = now
            log.error("limits: Redis unreachable, requests go unmetered meanwhile: %s", exc)
