"""A WSGI entry whose early refusal fails on every request (NOTE(loop) in http/workers.py): the
worker's loop must hand each request to the app instead of ending with the fault."""
from turbospark_wsgi.http.deps import deps_of
from turbospark_wsgi.wsgi import app

__all__ = ["app"]


def _broken(*args, **kwargs):
    raise RuntimeError("a fault in the early answer")


deps_of(app).refusal.answer = _broken
