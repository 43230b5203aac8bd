"""GET /health: 503 until the default model is loaded, then 200 with model, backend and queue."""
import falcon


class Health:
    def __init__(self, service):
        self._service = service

    def on_get(self, req, resp):
        body = self._service.health()
        resp.status = falcon.HTTP_200 if body["status"] == "ok" else falcon.HTTP_503
        resp.media = body
