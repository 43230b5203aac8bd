"""The HTTP edge: bytes and JSON in, JSON and event streams out; no model work here.

gunicorn_settings (gunicorn's settings and hooks) and workers (gunicorn workers, their early path
framed by framing) -> app (Falcon, middleware, the route table; refusal answers a full server or an
oversized body from the head; deps, what the app hands its worker and compute thread) ->
resources (one per route family) -> schemas (a request body checked into a serving request; a
reply or its stream frames rendered back, with parsers and sse). Below it: serving/.
"""
