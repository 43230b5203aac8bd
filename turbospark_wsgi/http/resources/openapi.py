"""GET /openapi.json: the OpenAPI 3.1 description of every route."""
from ... import __version__
from ..schemas.openapi_spec import spec


class OpenApi:
    def __init__(self):
        self._spec = spec(__version__)

    def on_get(self, req, resp):
        resp.media = self._spec
