"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters registered at run time
(vLLM's routes and plain-text replies); serving/adapters.py does the work."""
import falcon

from ..middleware import read_json
from ..schemas import lora


class LoadLoraAdapter:
    def __init__(self, service, max_body):
        self._service = service
        self._max_body = max_body

    def on_post(self, req, resp):
        name, path = lora.parse_load(read_json(req, self._max_body))
        self._service.lora.load(name, path)
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = lora.loaded_text(name)


class UnloadLoraAdapter:
    def __init__(self, service, max_body):
        self._service = service
        self._max_body = max_body

    def on_post(self, req, resp):
        name = lora.parse_unload(read_json(req, self._max_body))
        self._service.lora.unload(name)
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = lora.unloaded_text(name)
