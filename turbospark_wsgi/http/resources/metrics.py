"""GET /metrics: Prometheus text (all workers' samples when PROMETHEUS_MULTIPROC_DIR is set)."""
from ... import metrics


class Metrics:
    def __init__(self, service):
        self._service = service

    def on_get(self, req, resp):
        metrics.observe_queue(self._service.queue)
        resp.content_type = metrics.CONTENT_TYPE
        resp.data = metrics.exposition()
