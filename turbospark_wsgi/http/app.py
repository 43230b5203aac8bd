"""The Falcon app factory: media handlers, middleware, the route table and the error envelopes."""
import functools
import json
import logging

import falcon
import falcon.media

from ..config import Config
from ..errors import (ApiError, EngineError, InvalidRequest, MethodNotAllowed, NotFound, PayloadTooLarge,
                      Unauthorized, UnsupportedMediaType)
from ..serving import compute
from ..serving.batch_store import open_batch_store
from ..serving.response_store import open_store
from ..serving.service import Service
from .batch_runner import BatchRunner
from .deps import AppDeps, AppWithDeps
from .middleware import ApiKeyAuth, BodyLimit, Cors, RequestContext, request_id
from .refusal import EarlyRefusal
from .resources.batches import BatchCancel, BatchItem, Batches, FileContent, FileItem, Files
from .resources.chat import ChatCompletions
from .resources.completions import Completions
from .resources.embeddings import Embeddings
from .resources.health import Health
from .resources.lora import LoadLoraAdapter, UnloadLoraAdapter
from .resources.messages import CountTokens, Messages
from .resources.metrics import Metrics
from .resources.models import Model, Models
from .resources.moderations import Moderations
from .resources.openapi import OpenApi
from .resources.rerank import Rerank, Score
from .resources.responses import Responses, StoredResponse
from .resources.tokenize import Detokenize, Tokenize, TokenizerInfo
from .resources.webui import SINK_PATTERN, WebUi
from .schemas import common, openai

log = logging.getLogger("turbospark.app")

_FROM_STATUS = {400: InvalidRequest, 401: Unauthorized, 404: NotFound, 405: MethodNotAllowed,
                413: PayloadTooLarge, 415: UnsupportedMediaType}


def create_app(config=None, service=None, deps=None):
    """Builds the WSGI app.

    `config`: a `Config` (default `Config()`; `wsgi.py` passes `Config.from_env()`).
    `service`: a `Service` to use (tests inject one built on a fake registry); by default one is
    built from `config`. `deps`: the app's AppDeps (deps.py; by default built from `config` and
    `service`), which the app carries (`deps_of`) instead of installing them anywhere; it starts
    this process's compute thread with them. When `config.load_default` is true the default model
    starts loading on a background thread at once, so call this in the worker process (gunicorn
    `preload_app=False`); `/health` answers 503 until the model is loaded.
    """
    config = config or Config()
    service = service or Service(config)
    deps = deps or AppDeps.build(config, early_refusal(config, service))
    compute.start(deps.compute, deps.door)     # NOTE(one-thread): before any engine work
    # NOTE(order): CORS answers preflights before auth; its process_response also reaches 401s.
    app = AppWithDeps(deps, middleware=[RequestContext(config.replica_id, config.body_timeout),
                                        Cors(config.cors_origins), ApiKeyAuth(config.api_keys),
                                        BodyLimit(config.max_body,
                                                  {"/v1/files": config.batch_file_bytes + MULTIPART_HEADS})])
    app.req_options.strip_url_path_trailing_slash = True
    json_handler = falcon.media.JSONHandler(dumps=functools.partial(
        json.dumps, ensure_ascii=False, separators=(",", ":")))
    app.resp_options.media_handlers[falcon.MEDIA_JSON] = json_handler
    runner = add_routes(app, service, config)
    app.add_error_handler(Exception, _handle_unexpected)
    app.add_error_handler(falcon.HTTPError, _handle_http_error)
    app.add_error_handler(ApiError, _handle_api_error)
    if config.load_default:
        service.start_loading()
        runner.start()          # NOTE(resume): batches a stopped server left go on
    return app


def early_refusal(config, service):
    """The app's EarlyRefusal: a full server's 503 on the generation routes and a body's 413 on
    every JSON route, as `service` and the error handlers below would answer them."""
    # NOTE(overload): the worker answers these routes' first refusal (a full server) from the head
    return EarlyRefusal(service.check_room, config, REFUSED_WHEN_FULL, envelope_for, BODY_ROUTES)


MULTIPART_HEADS = 64 * 1024     # bytes an upload's body may hold beyond its file: the form's other parts

# The POST routes whose first step is Service.check_room (see refusal.py).
REFUSED_WHEN_FULL = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
# The POST routes that read a JSON body: the worker answers their 413 from a head over the limit.
RERANK_ROUTES = ("/v1/rerank", "/rerank", "/v2/rerank")     # vLLM's, Jina's; llama.cpp's; Cohere's
BODY_ROUTES = REFUSED_WHEN_FULL + ("/v1/embeddings", "/v1/messages/count_tokens", "/v1/moderations", "/tokenize",
                                   "/detokenize", "/v1/score", "/v1/batches", "/v1/load_lora_adapter",
                                   "/v1/unload_lora_adapter") + RERANK_ROUTES


def add_routes(app, service, config):
    """The route table: the only place a path is bound to a resource. Returns the app's BatchRunner."""
    app.add_route("/v1/completions", Completions(service, config.max_body))
    app.add_route("/v1/chat/completions", ChatCompletions(service, config.max_body))
    app.add_route("/v1/embeddings", Embeddings(service, config))
    rerank = Rerank(service, config)
    app.add_route("/v1/rerank", rerank)
    app.add_route("/rerank", rerank)
    app.add_route("/v2/rerank", rerank)
    app.add_route("/v1/score", Score(service, config))
    app.add_route("/v1/messages", Messages(service, config.max_body))
    app.add_route("/v1/messages/count_tokens", CountTokens(service, config.max_body))
    # NOTE(store): one store per app, so per worker process (the app is built after the fork), or
    # one in Redis for every replica (TURBOSPARK_REDIS).
    store = open_store(config)
    app.add_route("/v1/responses", Responses(service, store, config.max_body))
    app.add_route("/v1/responses/{response_id}", StoredResponse(store))
    app.add_route("/v1/moderations", Moderations(service, config))
    # NOTE(batch): files and batches on disk (TURBOSPARK_DATA) or in Redis: whichever worker or
    # replica takes a batch's lease runs it, any of them answers for it
    batch_store = open_batch_store(config)
    runner = BatchRunner(app, batch_store, config)
    app.add_route("/v1/files", Files(batch_store, config.body_timeout))
    app.add_route("/v1/files/{file_id}", FileItem(batch_store))
    app.add_route("/v1/files/{file_id}/content", FileContent(batch_store))
    app.add_route("/v1/batches", Batches(batch_store, config.max_body, runner.wake))
    app.add_route("/v1/batches/{batch_id}", BatchItem(batch_store))
    app.add_route("/v1/batches/{batch_id}/cancel", BatchCancel(batch_store, runner.wake))
    app.add_route("/v1/models", Models(service))
    app.add_route("/v1/models/{model_id:path}", Model(service))
    app.add_route("/v1/load_lora_adapter", LoadLoraAdapter(service, config.max_body))
    app.add_route("/v1/unload_lora_adapter", UnloadLoraAdapter(service, config.max_body))
    app.add_route("/health", Health(service))
    app.add_route("/tokenize", Tokenize(service, config.max_body))
    app.add_route("/detokenize", Detokenize(service, config.max_body))
    app.add_route("/tokenizer_info", TokenizerInfo(service))
    app.add_route("/metrics", Metrics(service))
    app.add_route("/openapi.json", OpenApi())
    if config.web_ui:
        # NOTE(sink): the chat page is no API route, so it stays out of the route table and the spec
        app.add_sink(WebUi(), SINK_PATTERN)
    return runner


def envelope_for(path):
    """The error body builder for a route family: Anthropic under /v1/messages, else OpenAI."""
    return common.anthropic_error_body if path.startswith("/v1/messages") else openai.error_body


def _handle_api_error(req, resp, ex, params):
    stream, resp.stream = resp.stream, None
    if hasattr(stream, "close"):
        stream.close()          # NOTE(streams): an unsent stream still holds its queue slot
    resp.status = ex.status
    resp.set_headers(ex.headers)
    resp.content_type = falcon.MEDIA_JSON
    resp.media = envelope_for(req.path)(ex)


def _handle_http_error(req, resp, ex, params):
    _handle_api_error(req, resp, from_http_error(req, ex), params)


def _handle_unexpected(req, resp, ex, params):
    rid = request_id(req)
    log.error("unhandled error [request %s] %s %s", rid, req.method, req.path, exc_info=ex)
    _handle_api_error(req, resp, EngineError(
        f"The server had an error while processing your request (request id {rid})"), params)


def from_http_error(req, ex):
    """A falcon.HTTPError (routing, headers, media) as the ApiError with the same status."""
    status = ex.status_code
    if status == 404:
        message = f"Unknown route: {req.method} {req.path}"
    elif status == 405:
        message = f"Method {req.method} is not allowed for {req.path}"
    else:
        message = ": ".join(p for p in (ex.title, ex.description) if p)
    cls = _FROM_STATUS.get(status)
    if cls is None:
        err = ApiError(message, headers=ex.headers)
        err.status = status
        err.type = "invalid_request_error" if status < 500 else "server_error"
        return err
    return cls(message, headers=ex.headers)
