"""LoRA adapters (PEFT directories, and llama.cpp's GGUF LoRA files) served on their base models:
those the models directory holds and those registered at run time (POST /v1/load_lora_adapter),
found by name, loaded onto their base's engine once per base load, and listed with the base as
their `parent`.

NOTE(lora-gguf-parent): a GGUF LoRA file names its base, if at all, as model-card metadata
(general.base_model.N.name, as llama.cpp's converter copies it), which rarely matches an installed
id; where none does, its parent is the default model (llama.cpp's `--lora` applies to the one model
it serves), and loading it onto that base checks that the architecture and shapes fit.

NOTE(lora-names): a request selects an adapter by its `model` name, as in vLLM: the base model's
engine runs it with the adapter, batched with the base's other runs (engine/lora.py).
"""
import logging
import os
import threading
from dataclasses import dataclass

from ..engine.model_json import read_object
from ..errors import InvalidRequest, NotFound

log = logging.getLogger("turbospark.adapters")

CONFIG_FILE = "adapter_config.json"


@dataclass(slots=True)
class AdapterEntry:
    name: str
    path: str                   # the adapter's directory (real path)
    parent: str | None          # the installed model it runs on; None: its base is not installed
    runtime: bool = False       # registered by POST /v1/load_lora_adapter (else found in the models directory)


def is_adapter_dir(path):
    """A PEFT adapter directory: adapter_config.json and no config.json of a model of its own."""
    return os.path.isfile(os.path.join(path, CONFIG_FILE)) and not os.path.isfile(os.path.join(path, "config.json"))


_gguf_adapters = {}     # (real path, size, mtime) -> a GGUF file's base model names if it is a LoRA adapter, else None


def _gguf_adapter_bases(path):
    """The base model names (general.base_model.N.name) of a GGUF file that says it is a LoRA
    adapter (general.type "adapter"), else None; its header read once per version of the file."""
    if not path.endswith(".gguf"):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _gguf_adapters:
        from ..engine.gguf import read_metadata
        try:
            meta = read_metadata(path) if os.path.isfile(path) else {}
        except (OSError, ValueError):
            meta = {}
        count = meta.get("general.base_model.count", 0)
        count = count if isinstance(count, int) and not isinstance(count, bool) else 0
        _gguf_adapters[key] = tuple(meta.get(f"general.base_model.{i}.name") for i in range(min(count, 16))) \
            if meta.get("general.type") == "adapter" else None
    return _gguf_adapters[key]


def is_adapter_file(path):
    """A GGUF file that says it is a LoRA adapter."""
    return _gguf_adapter_bases(path) is not None


def is_adapter(path):
    return is_adapter_dir(path) or is_adapter_file(path)


class Adapters:
    """The adapters `catalog` (a registry.Catalog) can reach, and each one's loaded form per base
    engine. `max_rank`: the largest rank accepted (TURBOSPARK_MAX_LORA_RANK)."""

    def __init__(self, config, catalog):
        self._config, self._catalog = config, catalog
        self._runtime = {}          # name -> AdapterEntry, registered at run time
        self._loaded = {}           # (name, path) -> (base engine, LoraAdapter, weights mtime)
        self._lock = threading.Lock()

    def entries(self):
        """Every adapter by name: the models directory's, then the run-time ones."""
        found = {}
        root = self._config.models_dir
        try:
            names = sorted(os.listdir(root))
        except OSError:
            names = []
        for entry in names:
            path = os.path.join(root, entry)
            if is_adapter_dir(path):
                found[entry] = AdapterEntry(entry, os.path.realpath(path), self._parent(path))
            elif is_adapter_file(path):
                found[entry[:-5]] = AdapterEntry(entry[:-5], os.path.realpath(path),
                                                 self._parent(path) or self._catalog.default_name)
        return {**found, **self._runtime}

    def find(self, name):
        return self.entries().get(name)

    def engine_for(self, entry, engine):
        """`engine` (the leased base) as an engine that runs adapter `entry`; a 400 naming the
        problem when the adapter does not fit it."""
        if not hasattr(engine, "with_adapter"):
            raise InvalidRequest(f"The model '{entry.parent}' does not run LoRA adapters", param="model",
                                 code="lora_adapter_invalid")
        key, mtime = (entry.name, entry.path), _weights_mtime(entry.path)
        with self._lock:
            held = self._loaded.get(key)
            if held is None or held[0] is not engine or held[2] != mtime:
                try:
                    adapter = engine.load_adapter(entry.path, entry.name, self._config.max_lora_rank)
                except (ValueError, OSError) as e:
                    raise InvalidRequest(f"The LoRA adapter '{entry.name}' cannot run on the model "
                                         f"'{entry.parent}': {_problem(e, entry.path)}", param="model",
                                         code="lora_adapter_invalid") from e
                held = self._loaded[key] = (engine, adapter, mtime)
                log.info("loaded LoRA adapter %s (rank %d, %s) onto %s", entry.name, adapter.rank,
                         ",".join(adapter.targets), entry.parent)
        return engine.with_adapter(held[1])

    def is_loaded(self, entry):
        return (entry.name, entry.path) in self._loaded

    def register(self, name, path, check):
        """Registers `name` for the directory `path` (inside the models directory) at run time,
        after `check(entry)` (loading it onto its base) succeeds. 400s naming the problem."""
        root = os.path.realpath(self._config.models_dir)
        real = os.path.realpath(os.path.join(root, path))
        if not real.startswith(root + os.sep):
            # NOTE(paths): a request never reads a file outside the models directory
            raise InvalidRequest("'lora_path' must name a directory inside the models directory", param="lora_path")
        if os.path.isfile(real):
            if not is_adapter_file(real):
                raise InvalidRequest("'lora_path' names a file that is not a GGUF LoRA adapter", param="lora_path")
        elif not os.path.isdir(real):
            raise InvalidRequest("'lora_path' names no directory in the models directory", param="lora_path")
        elif not os.path.isfile(os.path.join(real, CONFIG_FILE)):
            raise InvalidRequest(f"'lora_path' names a directory without {CONFIG_FILE}", param="lora_path")
        if name in self.entries() or self._catalog.find(name) is not None:
            raise InvalidRequest(f"The name '{name}' is taken: a model or LoRA adapter is already known by it",
                                 param="lora_name", code="lora_adapter_exists")
        entry = AdapterEntry(name, real, self._parent(real) or self._catalog.default_name, runtime=True)
        check(entry)
        with self._lock:
            self._runtime[name] = entry
        return entry

    def unregister(self, name):
        """Forgets a run-time adapter (runs already going keep it to their end)."""
        with self._lock:
            entry = self._runtime.pop(name, None)
            if entry is not None:
                self._loaded.pop((entry.name, entry.path), None)
                return entry
        if self.find(name) is not None:
            raise InvalidRequest(f"The LoRA adapter '{name}' is installed in the models directory; remove its "
                                 "directory there to unload it", param="lora_name")
        raise NotFound(f"The LoRA adapter '{name}' cannot be found", param="lora_name", code="lora_adapter_not_found")

    def _parent(self, path):
        """The installed model an adapter names: a directory's config `parent` (ours), else its
        `base_model_name_or_path`, a GGUF file's general.base_model.N.name (NOTE(lora-gguf-parent)),
        as an installed id or alias, else that name's last part."""
        try:
            names = _gguf_adapter_bases(path) or () if os.path.isfile(path) else \
                [(read_object(os.path.join(path, CONFIG_FILE), CONFIG_FILE) or {}).get(k)
                 for k in ("parent", "base_model_name_or_path")]
        except (OSError, ValueError):
            return None
        for value in names:
            if not isinstance(value, str) or not value:
                continue
            for name in (value, value.rstrip("/").rsplit("/", 1)[-1]):
                if self._catalog.find(name) is not None and not is_adapter(self._catalog.find(name)):
                    return name
        return None


def _weights_mtime(path):
    try:
        return os.stat(path if os.path.isfile(path) else os.path.join(path, "adapter_model.safetensors")).st_mtime
    except OSError:
        return 0.0


def _problem(error, path):
    """An adapter's load error for clients: the directory's base name instead of its path."""
    text = str(error) if isinstance(error, ValueError) else (error.strerror or type(error).__name__)
    return text.replace(path, os.path.basename(path))


class LoraAdmin:
    """vLLM's run-time routes on a registry.Registry: POST /v1/load_lora_adapter and
    /v1/unload_lora_adapter."""

    def __init__(self, registry):
        self._registry = registry

    def load(self, name, path):
        """Registers the adapter directory `path` (inside the models directory) as `name`, after
        loading it onto its base model (so a bad adapter is refused here, not by a later request)."""
        return self._registry.adapters.register(name, path, lambda entry: self._registry.acquire_adapter(entry).release())

    def unload(self, name):
        return self._registry.adapters.unregister(name)
