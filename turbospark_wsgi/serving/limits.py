"""Limits per client (TURBOSPARK_LIMITS_FILE): requests and tokens per minute, concurrent generations
and a daily token quota for each API key, one default for every key not listed (and, on a server
without keys, for each client address), and a concurrency cap per model.

    limits = Limits.from_config(config)         # ConfigError for a bad file
    permit = limits.admit(digest, address)      # RateLimited (429) when this client is over a limit
    events = permit.call(service.run, ...)      # refused later (4xx, full queue): the request is given back
    permit.meter(events)                        # prompt tokens now, completion tokens as they come;
                                                # settled, and the slot freed, when events close
    permit.settle(tokens)                       # or, with no generation (embeddings): charged, freed
    permit.headers(anthropic)                   # x-ratelimit-* (and anthropic-ratelimit-*)

NOTE(buckets): requests and tokens per minute are token buckets refilled continuously, empty to
full in one minute, which is how OpenAI and Anthropic describe theirs: a request takes one
request and needs at least one token left; its tokens are charged as they are produced, so a long
generation can take the bucket below zero, and the client's next request waits until the refill
has paid that back. The daily quota is a count per UTC day.

Counters live in this process (limits per replica) or, with TURBOSPARK_REDIS, in Redis
(limits_redis.py), shared by every replica. `reload_all()` re-reads every file (SIGHUP).
"""
import json
import logging
import math
import re
import threading
import time
import tomllib
import weakref
from dataclasses import dataclass, fields
from datetime import datetime, timezone

from .. import metrics
from ..config import ConfigError
from ..errors import Overloaded, RateLimited
from .limits_store import Levels, Store

log = logging.getLogger("turbospark.limits")

_DIGEST = re.compile(r"[0-9a-f]{64}")
_all = weakref.WeakSet()        # every Limits of this process, for reload_all()
DEFAULT_NAME = "default"        # the metrics' name for every client not listed
DAY = 86400.0


def reload_all():
    """SIGHUP: every Limits of this process re-reads its file (a bad file keeps the old limits)."""
    for limits in list(_all):
        limits.reload()


@dataclass(frozen=True, slots=True)
class Limit:
    """One client's limits; 0 is no limit."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    concurrent: int = 0
    tokens_per_day: int = 0

    def __bool__(self):
        return any((self.requests_per_minute, self.tokens_per_minute, self.concurrent, self.tokens_per_day))


_FIELDS = tuple(f.name for f in fields(Limit))


@dataclass(frozen=True, slots=True)
class Table:
    """A limits file, parsed: the default, each key's (name, Limit) by sha256 hex, each model's cap."""

    default: Limit = Limit()
    keys: dict = None
    models: dict = None

    @property
    def empty(self):
        return not self.default and not self.keys and not self.models


def read_table(path):
    """The Table in a TOML or JSON file (by its suffix; TOML unless .json); ConfigError when bad."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        data = json.loads(raw) if path.lower().endswith(".json") else tomllib.loads(raw.decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"TURBOSPARK_LIMITS_FILE cannot be read: {e.strerror} ({path})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"TURBOSPARK_LIMITS_FILE is not valid {_kind(path)}: {e} ({path})") from None
    return parse_table(data, path)


def parse_table(data, source="limits"):
    """A Table from the file's data:

        {"default": {LIMITS}, "keys": {NAME: {"sha256": HEX, LIMITS}, HEX: {LIMITS}},
         "models": {MODEL: {"concurrent": N}}}

    A key's own table names only what differs from the default. Keys appear by their sha256 only.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the limits file must hold a table")
    _only(data, ("default", "keys", "models"), source)
    default = _limit(data.get("default", {}), Limit(), f"{source} [default]")
    keys = {}
    for name, entry in _table(data.get("keys", {}), f"{source} [keys]").items():
        where = f"{source} [keys.{name}]"
        entry = dict(_table(entry, where))
        digest = str(entry.pop("sha256", name if _DIGEST.fullmatch(str(name).lower()) else "")).lower()
        if not _DIGEST.fullmatch(digest):
            raise ConfigError(f"{where}: give the key's sha256 (64 hex digits) as 'sha256', or use it as the "
                              f"table's name; keys are never written in plain text")
        if digest in keys:
            raise ConfigError(f"{where}: the same sha256 as [keys.{keys[digest][0]}]")
        shown = f"sha256:{digest[:12]}" if name.lower() == digest else name
        keys[digest] = (shown, _limit(entry, default, where))
    models = {}
    for name, entry in _table(data.get("models", {}), f"{source} [models]").items():
        where = f"{source} [models.{name}]"
        _only(_table(entry, where), ("concurrent",), where)
        models[name] = _count(entry.get("concurrent", 0), f"{where} concurrent")
    return Table(default, keys, models)


def _limit(entry, base, where):
    _only(_table(entry, where), _FIELDS, where)
    values = {f: _count(entry.get(f, getattr(base, f)), f"{where} {f}") for f in _FIELDS}
    return Limit(**values)


def _table(value, where):
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table")
    return value


def _only(entry, allowed, where):
    unknown = sorted(set(entry) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown setting {unknown[0]!r} (known: {', '.join(allowed)})")


def _count(value, where):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where} must be a whole number >= 0 (0: no limit), got {value!r}")
    return value


def _kind(path):
    return "JSON" if path.lower().endswith(".json") else "TOML"


@dataclass(frozen=True, slots=True)
class Subject:
    name: str           # the key's name in the file, or "default"
    bucket: str         # whose counters: a digest of the key, or the client's address
    limit: Limit


class Limits:
    """The limits of one server process; `store` (a limits_store.Store) keeps the counters: a
    MemoryStore by default, a RedisStore with TURBOSPARK_REDIS."""

    def __init__(self, path="", auth_enabled=False, store: Store | None = None, table=None):
        self.path = path
        self.auth_enabled = auth_enabled
        self.store = store if store is not None else MemoryStore()
        self.table = table if table is not None else (read_table(path) if path else Table())
        self._models, self._lock = {}, threading.Lock()       # model id -> generations running
        _all.add(self)

    @classmethod
    def from_config(cls, config):
        store = None
        if config.redis:
            from .limits_redis import RedisStore
            store = RedisStore(config.redis)
        return cls(config.limits_file, config.auth_enabled, store)

    def reload(self):
        """Re-reads the file; running generations keep the limits they were admitted under."""
        if not self.path:
            return
        try:
            self.table = read_table(self.path)
        except ConfigError as e:
            log.error("limits not reloaded, the previous ones stay: %s", e)
            return
        log.info("limits reloaded from %s: %d keys, %d model caps", self.path, len(self.table.keys),
                 len(self.table.models))

    def subject(self, digest, address):
        """Whose limits apply to a client presenting a key with sha256 `digest` (bytes; None: no
        key) from `address`: a listed key's; else the default, per key on a server with keys and
        per address on an open one (where any key is accepted, so a key names nobody)."""
        table = self.table
        if digest is not None:
            hexed = digest.hex()
            listed = table.keys.get(hexed) if table.keys else None
            if listed is not None:
                return Subject(listed[0], "key:" + hexed[:32], listed[1])
            if self.auth_enabled:
                return Subject(DEFAULT_NAME, "key:" + hexed[:32], table.default)
        return Subject(DEFAULT_NAME, "addr:" + (address or ""), table.default)

    def admit(self, digest, address, anthropic=False):
        """A Permit for one generation, or RateLimited when the client is over one of its limits
        (with Anthropic's headers too when `anthropic`)."""
        if self.table.empty:
            return Permit(self, None)
        subject = self.subject(digest, address)
        if not subject.limit:
            return Permit(self, subject)
        reason, levels, lease = self.store.admit(subject.bucket, subject.limit)
        if reason is not None:
            metrics.record_throttled(subject.name, reason)
            raise refusal(subject, reason, levels, anthropic)
        return Permit(self, subject, levels, lease)

    def take_model(self, model):
        """Counts a generation on `model`; Overloaded (503) when the model runs its cap already."""
        cap = (self.table.models or {}).get(model, 0)
        with self._lock:
            running = self._models.get(model, 0)
            if cap and running >= cap:
                raise Overloaded(f"the model '{model}' runs {cap} generations at once, its limit; retry shortly",
                                 retry_after=1, code="model_overloaded")
            self._models[model] = running + 1

    def give_model(self, model):
        with self._lock:
            self._models[model] -= 1


class Permit:
    """One admitted generation's hold on its client's limits."""

    def __init__(self, limits, subject, levels=None, lease=None):
        self._limits, self.subject, self.levels, self._lease = limits, subject, levels, lease
        self._events, self._model, self._charged, self._counted = None, None, 0, 0
        self._flushed_at, self._closed = time.monotonic(), False

    def headers(self, anthropic=False):
        """The rate-limit headers for the response: nothing when no limit applies."""
        if self.levels is None:
            return {}
        return limit_headers(self.subject.limit, self.levels, anthropic)

    def call(self, fn, *args):
        """`fn(*args)`; when it raises (refused after admission: a 4xx, a full queue) the request
        counts for nothing."""
        try:
            return fn(*args)
        except BaseException:
            self.refund()
            raise

    def refund(self):
        if self.levels is not None and not self._closed:
            self._closed = True
            self._limits.store.settle(self.subject.bucket, self.subject.limit, 0, -1, self._lease)

    def settle(self, tokens):
        """A request that generates nothing (embeddings): its tokens charged, its place freed."""
        if self.levels is not None and not self._closed:
            self._closed = True
            self.levels = self._charge(tokens, "prompt", release=True) or self.levels

    def meter(self, events):
        """Charges `events`' prompt tokens now, its completion tokens as they are produced, settles
        when it closes; takes a place under its model's cap (Overloaded: events closed, refunded)."""
        try:
            self._limits.take_model(events.model_id)
        except Overloaded:
            events.close()
            self.refund()
            raise
        self._events, self._model = events, events.model_id
        events.on_close(self._close)
        if self.levels is not None:
            # NOTE(headers): the response's headers show the bucket with the prompt paid for
            self.levels = self._charge(events.prompt_tokens, "prompt") or self.levels
            events.on_token(self._on_token)

    def _on_token(self):
        self._counted += 1
        now = time.monotonic()
        if now - self._flushed_at >= self._limits.store.flush_every:
            self._flushed_at = now
            self._charge(self._counted - self._charged, "completion")

    def _charge(self, tokens, kind, release=False):
        """Levels after charging `tokens` (None: nothing to charge, or the store unreachable)."""
        if kind == "completion":
            self._charged += tokens
        if tokens > 0:
            metrics.record_key_tokens(self.subject.name, kind, tokens)
        if tokens or release:
            return self._limits.store.settle(self.subject.bucket, self.subject.limit, tokens, 0,
                                             self._lease if release else None)
        return None

    def _close(self):
        if self._closed:
            return
        self._closed = True
        self._limits.give_model(self._model)
        if self.levels is not None:
            # NOTE(settle): the final count, exact even where a token event was not one of usage's
            self._charge(self._events.produced_tokens - self._charged, "completion", release=True)


def refusal(subject, reason, levels, anthropic=False):
    """The 429 for a client over `reason`'s limit, with the headers of every limit it has."""
    limit, now = subject.limit, levels.now
    who = "this client" if subject.name == DEFAULT_NAME else f"the key '{subject.name}'"
    if reason == "requests":
        rate = limit.requests_per_minute / 60
        wait = (1 - levels.requests) / rate
        what, kind = f"requests per minute (RPM): limit {limit.requests_per_minute}", "requests"
    elif reason == "tokens":
        rate = limit.tokens_per_minute / 60
        wait = (1 - levels.tokens) / rate
        what, kind = f"tokens per minute (TPM): limit {limit.tokens_per_minute}", "tokens"
    elif reason == "concurrency":
        wait = 1.0
        what, kind = f"concurrent generations: limit {limit.concurrent}", "concurrency"
    else:
        wait = _next_day(now) - now
        what, kind = f"tokens per day: limit {limit.tokens_per_day}", "insufficient_quota"
    message = f"Rate limit reached for {who} on {what}. Please try again in {duration(wait)}."
    return RateLimited(message, type=kind, retry_after=wait, headers=limit_headers(limit, levels, anthropic))


def limit_headers(limit, levels, anthropic):
    """OpenAI's x-ratelimit-* headers (and on /v1/messages Anthropic's anthropic-ratelimit-*) for
    the limits that apply: remaining counts and the time until each bucket is full again."""
    out, now = {}, levels.now
    for kind, per_minute, level in (("requests", limit.requests_per_minute, levels.requests),
                                    ("tokens", limit.tokens_per_minute, levels.tokens)):
        if not per_minute:
            continue
        remaining = max(int(math.floor(level)), 0)
        to_full = max(per_minute - level, 0) / (per_minute / 60)
        out[f"x-ratelimit-limit-{kind}"] = str(per_minute)
        out[f"x-ratelimit-remaining-{kind}"] = str(remaining)
        out[f"x-ratelimit-reset-{kind}"] = duration(to_full)
        if anthropic:
            out[f"anthropic-ratelimit-{kind}-limit"] = str(per_minute)
            out[f"anthropic-ratelimit-{kind}-remaining"] = str(remaining)
            out[f"anthropic-ratelimit-{kind}-reset"] = rfc3339(now + to_full)
    return out


def duration(seconds):
    """OpenAI's reset format: "20ms", "1s", "1.5s", "6m0s", "1h2m3s"."""
    ms = max(math.ceil(seconds * 1000), 0)
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    minutes, secs = divmod(ms / 1000, 60)
    hours, minutes = divmod(int(minutes), 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + text


def rfc3339(unix):
    return datetime.fromtimestamp(math.ceil(unix), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _next_day(unix):
    return (math.floor(unix / DAY) + 1) * DAY


def refill(level, at, now, per_minute):
    """A bucket's level at `now`, refilled since `at` at `per_minute` per minute, up to full."""
    return min(per_minute, level + max(now - at, 0.0) * per_minute / 60)


def verdict(limit, requests, tokens, day_used, active):
    """The limit a request would go over now, or None."""
    if limit.requests_per_minute and requests < 1:
        return "requests"
    if limit.tokens_per_minute and tokens < 1:
        return "tokens"
    if limit.tokens_per_day and day_used >= limit.tokens_per_day:
        return "daily_tokens"
    if limit.concurrent and active >= limit.concurrent:
        return "concurrency"
    return None


class _Counters:
    __slots__ = ("requests", "tokens", "at", "day", "used", "active", "limit")

    def __init__(self, limit, now, day):
        self.requests, self.tokens, self.at = limit.requests_per_minute, limit.tokens_per_minute, now
        self.day, self.used, self.active, self.limit = day, 0, 0, limit

    def full(self, now):
        limit = self.limit
        return (refill(self.requests, self.at, now, limit.requests_per_minute) >= limit.requests_per_minute
                and refill(self.tokens, self.at, now, limit.tokens_per_minute) >= limit.tokens_per_minute)


class MemoryStore:
    """The counters in this process (a limits_store.Store): the limits hold per replica."""

    flush_every = 0.0           # completion tokens are charged one by one (a lock, no I/O)
    PRUNE_EVERY = 1024

    def __init__(self, clock=time.time):
        self._clock = clock
        self._counters, self._lock, self._admits = {}, threading.Lock(), 0

    def admit(self, bucket, limit):
        """(reason or None, Levels, lease): takes a request and a concurrency place when none is over."""
        with self._lock:
            c = self._refill(bucket, limit)
            reason = verdict(limit, c.requests, c.tokens, c.used, c.active)
            if reason is None:
                c.requests -= 1 if limit.requests_per_minute else 0
                c.active += 1
            levels = Levels(c.requests, c.tokens, c.used, c.at)
            self._admits += 1
            if self._admits % self.PRUNE_EVERY == 0:
                self._prune()
        return reason, levels, None if reason else bucket

    def settle(self, bucket, limit, tokens, requests, lease):
        """Charges `tokens` (and `requests`: -1 gives one back); `lease` ends the generation's place.
        Returns the Levels after it."""
        with self._lock:
            c = self._refill(bucket, limit)
            c.tokens -= tokens if limit.tokens_per_minute else 0
            c.used += tokens
            if requests and limit.requests_per_minute:
                c.requests = min(c.requests - requests, limit.requests_per_minute)
            if lease is not None:
                c.active -= 1
            return Levels(c.requests, c.tokens, c.used, c.at)

    def _refill(self, bucket, limit):
        now = self._clock()
        day = math.floor(now / DAY)
        c = self._counters.get(bucket)
        if c is None:
            c = self._counters[bucket] = _Counters(limit, now, day)
        c.requests = refill(c.requests, c.at, now, limit.requests_per_minute)
        c.tokens = refill(c.tokens, c.at, now, limit.tokens_per_minute)
        c.at, c.limit = now, limit
        if c.day != day:
            c.day, c.used = day, 0
        return c

    def _prune(self):
        # NOTE(memory): an open server meets many addresses; a client back to full buckets, with
        # nothing running and no tokens today, is the same as one never seen.
        now = self._clock()
        day = math.floor(now / DAY)
        for bucket, c in list(self._counters.items()):
            quota_used = c.limit.tokens_per_day and c.used and c.day == day
            if not c.active and not quota_used and c.full(now):
                del self._counters[bucket]
