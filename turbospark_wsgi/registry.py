"""Installed models: discovery in the models directory, aliases, and loading on first request."""
import json
import logging
import os
import threading
from dataclasses import dataclass

from . import compute
from .errors import ModelLoadError, ModelNotFound

log = logging.getLogger("turbospark.registry")

BUILTIN_ALIASES = {"smollm2-135m-instruct": "SmolLM2-135M-Instruct.Q4_1.gguf"}
ALIASES_FILE = "aliases.json"


@dataclass(slots=True)
class ModelInfo:
    id: str
    path: str
    loaded: bool
    created: int
    alias_of: str | None = None     # the installed id an alias points at


class Registry:
    """Finds models by id, alias or path and loads each once (on the compute thread).

    `loader(path, device=, name=, max_context=, prefill_chunk=)` defaults to
    `turbospark_wsgi.engine.load_engine`; tests inject a fake.
    """

    def __init__(self, config, loader=None):
        self._config = config
        self._loader = loader
        self._engines = {}          # real path -> Engine
        self._failures = {}         # real path -> (mtime, message)
        self._locks = {}            # real path -> Lock
        self._guard = threading.Lock()

    @property
    def default_name(self):
        return self._config.model

    def list(self):
        """Installed models and aliases whose target exists, plus the default model if it is a path."""
        installed = self._installed()
        infos = [self._info(mid, path) for mid, path in installed.items()]
        for alias, target in self._aliases().items():
            path = self._target_path(target, installed)
            if path and alias not in installed:
                infos.append(self._info(alias, path, alias_of=_id_for(path, installed)))
        if not any(i.id == self.default_name for i in infos):
            found = self.find(self.default_name)
            if found:
                infos.append(self._info(self.default_name, found))
        return infos

    def find(self, name):
        """The file or directory for an id, alias or local path; None when unknown."""
        installed = self._installed()
        if name in installed:
            return installed[name]
        target = self._aliases().get(name)
        if target is not None:
            return self._target_path(target, installed)
        folded = {k.casefold(): v for k, v in installed.items()}
        if name.casefold() in folded:
            return folded[name.casefold()]
        return name if _is_model_path(name) else None

    def loaded(self, name=None):
        """The engine for `name` (default: the default model) if it is loaded, else None."""
        path = self.find(name or self.default_name)
        return self._engines.get(os.path.realpath(path)) if path else None

    def resolve(self, name=None):
        """The engine for `name`, loading it on first use. ModelNotFound / ModelLoadError otherwise."""
        name = name or self.default_name
        path = self.find(name)
        if path is None:
            raise ModelNotFound(f"The model '{name}' does not exist or is not installed", param="model")
        key = os.path.realpath(path)
        engine = self._engines.get(key)
        return engine if engine is not None else self._load(name, key)

    def _load(self, name, key):
        with self._lock_for(key):
            if key in self._engines:
                return self._engines[key]
            mtime = _mtime(key)
            failed = self._failures.get(key)
            if failed and failed[0] == mtime:
                raise ModelLoadError(failed[1])
            try:
                engine = compute.run(self._load_fn(), key, device=self._config.device,
                                     name=_id_for(key, self._installed()),
                                     max_context=self._config.max_context,
                                     prefill_chunk=self._config.prefill_chunk)
            except (ValueError, OSError, ImportError) as e:
                self._failures[key] = (mtime, f"The model '{name}' could not be loaded: {e}")
                log.error("loading %s failed: %s", key, e)
                raise ModelLoadError(self._failures[key][1]) from e
            log.info("loaded %s from %s (backend %s)", name, key, getattr(engine, "backend", "?"))
            self._engines[key] = engine
            return engine

    def _load_fn(self):
        if self._loader is None:
            from .engine import load_engine
            self._loader = load_engine
        return self._loader

    def _lock_for(self, key):
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def _installed(self):
        root = self._config.models_dir
        try:
            names = sorted(os.listdir(root))
        except OSError:
            return {}
        found = {}
        for entry in names:
            path = os.path.join(root, entry)
            if entry.endswith(".gguf") and os.path.isfile(path):
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

    def _info(self, model_id, path, alias_of=None):
        return ModelInfo(id=model_id, path=path, loaded=os.path.realpath(path) in self._engines,
                         created=int(_mtime(path)), alias_of=alias_of)


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

