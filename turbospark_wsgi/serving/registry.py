"""Installed models: what the models directory holds and the names that find it (Catalog), and the
loaded engines (Registry): loading on first request, leases, and unloading of idle models (least
recently used first) to stay within a memory budget."""
import dataclasses
import gc
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from .. import metrics
from ..engine.model_json import is_classifier_dir
from ..errors import InvalidRequest, ModelLoadError, ModelNotFound, Overloaded
from ..pull import SOURCES
from . import compute
from .adapters import Adapters, is_adapter_file

log = logging.getLogger("turbospark.registry")

# a pulled model's name is an alias of its file where the file is named otherwise
BUILTIN_ALIASES = {name: source.filename for name, source in SOURCES.items() if source.filename != name}
ALIASES_FILE = "aliases.json"


@dataclass(slots=True)
class ModelInfo:
    id: str
    path: str
    loaded: bool
    created: int
    alias_of: str | None = None     # the installed id an alias points at
    kind: str = "generation"        # "embedding": a sentence-transformers encoder (/v1/embeddings only);
                                    # "rerank": a cross-encoder (/v1/rerank, /v1/score only)
    chat_template: dict | None = None   # a loaded generator's: {"usable": bool, "reason"?: why not}
    parent: str | None = None       # a LoRA adapter's base model id (serving/adapters.py)

    @property
    def capabilities(self):
        """The routes' kinds it serves: a decoder generates and embeds, an encoder only embeds, a
        cross-encoder only reranks, a LoRA adapter only generates."""
        return ("generation",) if self.parent else model_capabilities(self.kind)


@dataclass(slots=True)
class _Loaded:
    engine: object
    nbytes: int                     # estimated from the model's file sizes
    users: int = 0                  # generations holding a Lease; never unloaded while > 0


class Lease:
    """A loaded engine held for one generation; `release()` (idempotent) makes it unloadable again."""

    __slots__ = ("engine", "_registry", "_key")

    def __init__(self, registry, key, engine):
        self.engine, self._registry, self._key = engine, registry, key

    def release(self):
        if self._registry is not None:
            registry, self._registry = self._registry, None
            registry._release(self._key)


class Catalog:
    """What the models directory holds: installed ids (GGUF files, model directories), aliases
    (built in and aliases.json) and the default model, found by name; nothing here loads a model."""

    def __init__(self, config):
        self._config = config

    @property
    def default_name(self):
        return self._config.model

    def list(self, loaded=()):
        """Installed models and aliases whose target exists, plus the default model if it is a path;
        `loaded`: the real paths of the models loaded now."""
        installed = self.installed()
        infos = [self._info(mid, path, loaded) for mid, path in installed.items()]
        for alias, target in self._aliases().items():
            path = self._target_path(target, installed)
            if path and alias not in installed:
                infos.append(self._info(alias, path, loaded, alias_of=_id_for(path, installed)))
        if not any(i.id == self.default_name for i in infos):
            found = self.find(self.default_name)
            if found:
                infos.append(self._info(self.default_name, found, loaded))
        return infos

    def find(self, name):
        """The file or directory for an installed id or alias (any case), or for the exact string the
        operator configured as the default model (which may be a path); None otherwise.

        NOTE(paths): a name from a request is looked up, never joined onto a path or opened: a
        request can reach only what the operator put in the models directory (symlinks and alias
        targets included) or named as the default, and an unknown name says nothing about files."""
        installed = self.installed()
        if name in installed:
            return installed[name]
        target = self._aliases().get(name)
        if target is not None:
            return self._target_path(target, installed)
        folded = {k.casefold(): v for k, v in installed.items()}
        if name.casefold() in folded:
            return folded[name.casefold()]
        return name if name == self.default_name and _is_model_path(name) else None

    def installed(self):
        root = self._config.models_dir
        try:
            names = sorted(os.listdir(root))
        except OSError:
            return {}
        found = {}
        for entry in names:
            path = os.path.join(root, entry)
            if entry.endswith(".gguf") and os.path.isfile(path) and not is_adapter_file(path):
                found[entry[:-5]] = path
            elif os.path.isfile(os.path.join(path, "config.json")):
                found[entry] = path
        return found

    def _aliases(self):
        aliases = dict(BUILTIN_ALIASES)
        path = os.path.join(self._config.models_dir, ALIASES_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                extra = json.load(f)
        except FileNotFoundError:
            return aliases
        except (OSError, ValueError) as e:
            log.warning("ignoring %s: %s", path, e)
            return aliases
        if isinstance(extra, dict):
            aliases.update({k: v for k, v in extra.items() if isinstance(k, str) and isinstance(v, str)})
        return aliases

    def _target_path(self, target, installed):
        if target in installed:
            return installed[target]
        path = os.path.join(self._config.models_dir, os.path.expanduser(target))
        return path if os.path.exists(path) else None

    def _info(self, model_id, path, loaded, alias_of=None):
        return ModelInfo(id=model_id, path=path, loaded=os.path.realpath(path) in loaded,
                         created=int(_mtime(path)), alias_of=alias_of,
                         kind=model_kind(path))


class Registry:
    """Finds models by id, alias or path and loads each once (on the compute thread).

    With `config.model_memory` (bytes) set, loading a model first unloads idle models, least
    recently used first, until the estimated sizes fit; models held by a `Lease` stay.
    `loader(path, options=EngineOptions, name=)` defaults to `turbospark_wsgi.engine.load_engine`;
    tests inject a fake.
    """

    def __init__(self, config, loader=None):
        self._config = config
        self.catalog = Catalog(config)
        self._loader = loader
        self._engines = OrderedDict()   # real path -> _Loaded, least recently used first
        self._failures = {}         # real path -> (mtime, message)
        self._locks = {}            # real path -> Lock
        self._guard = threading.Lock()
        self.adapters = Adapters(config, self.catalog)

    @property
    def default_name(self):
        return self._config.model

    def list(self):
        """The catalogue's models (Catalog.list), each saying whether it is loaded now and, once
        loaded, whether its chat template passed the load's probe."""
        infos = self.catalog.list(self._engines)
        for info in infos:
            entry = self._engines.get(os.path.realpath(info.path))
            template = getattr(entry.engine, "template", None) if entry is not None else None
            if template is not None:
                info.chat_template = template_status(template)
        return infos + [ModelInfo(id=a.name, path=a.path, loaded=self.adapters.is_loaded(a), created=int(_mtime(a.path)),
                                  parent=a.parent) for a in self.adapters.entries().values() if a.parent]

    def find(self, name):
        return self.catalog.find(name)

    def loaded(self, name=None):
        """The engine for `name` (default: the default model) if it is loaded, else None."""
        path = self.find(name or self.default_name)
        entry = self._engines.get(os.path.realpath(path)) if path else None
        return entry.engine if entry else None

    def resolve(self, name=None):
        """The engine for `name`, loading it on first use. ModelNotFound / ModelLoadError otherwise."""
        lease = self.acquire(name)
        lease.release()
        return lease.engine

    def acquire(self, name=None):
        """A Lease on the engine for `name` (loading it on first use); release it when done."""
        name = name or self.default_name
        path = self.find(name)
        adapter = self.adapters.find(name) if path is None else None
        if adapter is not None:
            return self.acquire_adapter(adapter)
        if path is None:
            raise ModelNotFound(f"The model '{name}' does not exist or is not installed", param="model")
        key = os.path.realpath(path)
        with self._guard:
            entry = self._engines.get(key)
            if entry is not None:
                return self._lease(key, entry)
        return self._load(name, key)

    def acquire_adapter(self, adapter):
        """A Lease on adapter's base engine, its `engine` running the adapter (adapters.py)."""
        if adapter.parent is None:
            raise InvalidRequest(f"The LoRA adapter '{adapter.name}' names a base model that is not installed",
                                 param="model", code="lora_adapter_invalid")
        lease = self.acquire(adapter.parent)
        try:
            lease.engine = self.adapters.engine_for(adapter, lease.engine)
        except BaseException:
            lease.release()
            raise
        return lease

    def _lease(self, key, entry):
        entry.users += 1                 # caller holds self._guard
        self._engines.move_to_end(key)
        return Lease(self, key, entry.engine)

    def _release(self, key):
        with self._guard:
            entry = self._engines.get(key)
            if entry is not None and entry.users > 0:
                entry.users -= 1

    def _load(self, name, key):
        with self._lock_for(key):
            with self._guard:
                if key in self._engines:
                    return self._lease(key, self._engines[key])
            mtime = _mtime(key)
            failed = self._failures.get(key)
            if failed and failed[0] == mtime:
                raise ModelLoadError(_load_failed(name, failed[1]))
            nbytes = estimate_bytes(key)
            self._make_room(name, nbytes)
            engine = self._load_engine(name, key, mtime)
            with self._guard:
                self._engines[key] = _Loaded(engine, nbytes)
                self._observe()
                return self._lease(key, self._engines[key])

    def _load_engine(self, name, key, mtime):
        started = time.monotonic()
        model_id = _id_for(key, self.catalog.installed())
        try:
            engine = compute.run(self._loader_for(key), key, options=self._options_for(key), name=model_id)
        except Exception as e:     # noqa: BLE001 - any failure to load a file is that model's failure
            if isinstance(e, (ValueError, OSError, ImportError, KeyError)):
                log.error("loading %s failed: %s", key, e)
            else:
                log.exception("loading %s failed unexpectedly", key)
            # NOTE(fault): remembered per file and mtime, so a bad file is not parsed again per request
            self._failures[key] = (mtime, _problem(e, key))
            metrics.record_model_load(model_id, False, time.monotonic() - started)
            raise ModelLoadError(_load_failed(name, self._failures[key][1])) from e
        held = getattr(getattr(engine, "loaded", None), "weights", "")
        log.info("loaded %s from %s (backend %s%s%s)", name, key, engine.backend,
                 f"; kernels: {engine.kernels}" if getattr(engine, "kernels", "") else "", f"; {held}" if held else "")
        problem = getattr(getattr(engine, "template", None), "problem", None)
        if problem:
            log.warning("%s: its chat template was refused (%s); chat routes are off for it, "
                        "/v1/completions serves it", name, problem)
        metrics.record_model_load(model_id, True, time.monotonic() - started)
        if _freeze_after_load:
            freeze_heap()
        return engine

    def _options_for(self, key):
        """The engine options for the model at `key`: the config's, with the draft model's path
        (TURBOSPARK_DRAFT_MODEL) for any model but the draft itself."""
        options, draft = self._config.engine_options(), self._config.draft_model
        if not draft or model_kind(key) != "generation":
            return options
        path = self.find(draft) or (draft if _is_model_path(draft) else None)
        if path is None:
            raise ValueError(f"TURBOSPARK_DRAFT_MODEL {draft!r} names no installed model")
        if os.path.realpath(path) == key:
            return options
        return dataclasses.replace(options, draft_model=path)

    def _make_room(self, name, nbytes):
        """Unloads idle models, least recently used first, until `nbytes` more fit the budget."""
        budget = self._config.model_memory
        if not budget:
            return
        if nbytes > budget:
            raise ModelLoadError(f"The model '{name}' needs about {nbytes} bytes, more than the memory "
                                 f"budget TURBOSPARK_MODEL_MEMORY={budget}")
        unloaded = False
        with self._guard:
            for key in [k for k, e in self._engines.items() if e.users == 0]:
                if self._used() + nbytes <= budget:
                    break
                entry = self._engines.pop(key)
                unloaded = True
                log.info("unloaded %s (idle) to make room for %s", entry.engine.name, name)
                metrics.record_unload(entry.engine.name)
            self._observe()
            full = self._used() + nbytes > budget
        if unloaded:
            _after_unload()
        if full:
            raise Overloaded(f"The model '{name}' cannot be loaded now: the models in use fill the memory "
                             f"budget ({self._used()} of {budget} bytes); retry later", retry_after=5)

    def _used(self):
        return sum(e.nbytes for e in self._engines.values())

    def _observe(self):
        metrics.observe_models(len(self._engines), self._used())

    def _load_fn(self):
        if self._loader is None:
            from ..engine import load_engine
            self._loader = load_engine
        return self._loader

    def _loader_for(self, key):
        """The cross-encoder's loader for a reranker, the encoder's for a sentence-transformers
        directory, else the decoder's."""
        kind = model_kind(key)
        if kind == "rerank":
            from ..engine.cross_encoder import load_cross_encoder
            return load_cross_encoder
        if kind == "embedding":
            from ..engine.encoder import load_encoder
            return load_encoder
        return self._load_fn()

    def _lock_for(self, key):
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

_freeze_after_load = False


def freeze_after_load(enabled=True):
    """Makes each model load and unload in this process end with freeze_heap(). The server's
    workers turn it on; a process that embeds the app decides for its own heap."""
    global _freeze_after_load
    _freeze_after_load = bool(enabled)


def _after_unload():
    """What an unload leaves behind, put away: the C kernels' scratch, which is the compute thread's
    and sized for the largest call any model made (NOTE(scratch)), freed there before the next load
    and made again as calls need it; and the heap frozen again where loads freeze it (NOTE(gc): the
    unloaded model's cycles were frozen with it)."""
    from ..engine import release_scratch
    compute.submit(release_scratch)
    if _freeze_after_load:
        freeze_heap()


def freeze_heap():
    """Collects once, then leaves every object alive now out of later collections (gc.freeze).

    PERF(gc): a loaded model leaves ~120k long-lived objects (numba's dispatchers and types, the
    tokenizer's tables, the template), and each full collection walked them all with the GIL held:
    130 ms in-process for SmolLM2, 25-110 ms stalls in a running worker, for every stream and every
    refusal at once. Frozen, a full collection walks only what came after: under 1 ms. Thawed and
    collected again at each load and unload, so an unloaded model's cycles are freed."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def template_status(template):
    """/v1/models' `chat_template` of a loaded model: whether chat routes serve it, and why not."""
    problem = getattr(template, "problem", None)
    return {"usable": True} if problem is None else {"usable": False, "reason": problem}


def model_capabilities(kind):
    return {"embedding": ("embedding",), "rerank": ("rerank",)}.get(kind, ("generation", "embedding"))


def model_kind(path):
    """"rerank" for a cross-encoder (config.json names a ...ForSequenceClassification architecture;
    asked first: sentence-transformers saves a CrossEncoder with a modules.json too), "embedding"
    for a sentence-transformers directory, else "generation"."""
    if is_classifier_dir(path):
        return "rerank"
    return "embedding" if is_embedding_model(path) else "generation"


def is_embedding_model(path):
    """A sentence-transformers directory (its modules.json says so): an embedding model."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "modules.json"))


def estimate_bytes(path):
    """A model's memory estimate: its file size, or for a directory the sum of its weight files."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                     if f.endswith((".safetensors", ".bin", ".gguf")))
    return total


def _problem(error, path):
    """What went wrong loading `path`, for clients: no file system paths, whichever exception said it."""
    if isinstance(error, OSError):
        text = error.strerror or type(error).__name__
    elif isinstance(error, (ValueError, ImportError, KeyError)):
        text = str(error)
    else:
        text = f"the file could not be read ({type(error).__name__})"
    for place, shown in ((path, os.path.basename(path)), (os.path.dirname(path), "<models>")):
        if len(place) > 1:
            text = text.replace(place, shown)
    return text


def _load_failed(name, problem):
    return f"The model '{name}' could not be loaded: {problem}"


def _is_model_path(name):
    if os.sep not in name and not name.endswith(".gguf"):
        return False        # NOTE(paths): a bare word is a model id, never a file in the cwd
    return os.path.isfile(name) or os.path.isfile(os.path.join(name, "config.json"))


def _id_for(path, installed):
    real = os.path.realpath(path)
    for mid, p in installed.items():
        if os.path.realpath(p) == real:
            return mid
    base = os.path.basename(real.rstrip(os.sep))
    return base[:-5] if base.endswith(".gguf") else base


def _mtime(path):
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0

