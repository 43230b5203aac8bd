"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): request bodies in, replies out.

    {"lora_name": "my-lora", "lora_path": "my-lora-dir"}  -> "Success: LoRA adapter 'my-lora' added successfully."
    {"lora_name": "my-lora"}                              -> "Success: LoRA adapter 'my-lora' removed successfully."

`lora_path` is a directory inside the models directory (relative to it, or absolute there).
"""
from ...errors import InvalidRequest
from .common import expect_object, type_name

NAME_LIMIT = 256            # characters of an adapter's name
PATH_LIMIT = 4096


def parse_load(doc):
    """-> (lora_name, lora_path)."""
    expect_object(doc)
    return _text(doc, "lora_name", NAME_LIMIT), _text(doc, "lora_path", PATH_LIMIT)


def parse_unload(doc):
    """-> lora_name."""
    expect_object(doc)
    return _text(doc, "lora_name", NAME_LIMIT)


def loaded_text(name):
    return f"Success: LoRA adapter '{name}' added successfully."


def unloaded_text(name):
    return f"Success: LoRA adapter '{name}' removed successfully."


def _text(doc, key, limit):
    value = doc.get(key)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"'{key}' must be a non-empty string, got {type_name(value)}", param=key)
    if len(value) > limit or "\x00" in value:
        raise InvalidRequest(f"'{key}' must be at most {limit} characters, without NUL", param=key)
    return value
