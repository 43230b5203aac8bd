"""The seam between HTTP and the engine: eager admission, then lazy generation as service events.

    events = service.run(GenerationRequest(...), CancelToken())   # ApiError here: nothing sent yet
    for event in events:       # KeepAlive | TextDelta | Finished; ends without Finished if cancelled
        ...
    events.close()             # idempotent: cancels, stops the engine, releases the queue slot
"""
import contextlib
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field

from .. import metrics
from ..engine import QueryTooLong
from ..errors import ApiError, InvalidRequest
from . import compute, priority
from .adapters import LoraAdmin
from .cancel import CancelToken
from .chat_plan import ChatPart
from .generation import Generation, PromptBatch
from .guardrails import Guardrails
from .limits import Limits
from .params import Sampling
from .prompts import Prompts, chat_plan, check_ids, encode_text, keep_last, template_source, truncation
from .queue import LockQueue
from .registry import Registry

log = logging.getLogger("turbospark.service")


@dataclass(slots=True)
class GenerationRequest:
    """One generation, as the schemas hand it to the service (one of prompt / prompt_ids / chat /
    prompts). Every field was checked without a model; the service does the rest."""

    model: str | None = None                # None: the default model
    prompt: str | None = None               # raw text (completions)
    prompt_ids: list | None = None          # token ids given by the client
    chat: ChatPart | None = None            # messages through the model's template, planned against it
                                            # (chat_plan.plan_output) once the model is leased
    prompts: list | None = None             # completions: several prompts, each text or token ids
    add_special: bool = True                # raw text: BOS where the model's own rule puts one; False: never
    max_tokens: int | None = 16             # None: up to the end of the context
    sampling: Sampling = field(default_factory=Sampling)    # the engine's params come at admission (params.py)
    stream: bool = False
    include_usage: bool = False             # stream_options.include_usage
    echo: bool = False                      # completions: each choice starts with the prompt text
    logprobs: int | None = None             # None: no logprobs; N: the chosen token's plus the top N
    n: int = 1                              # choices returned
    best_of: int | None = None              # choices generated (the n with the best cumulative logprob win)
    request_id: str = ""
    client: str = ""                        # whose request (an API key's digest or an address): the
                                            # queue takes turns between clients
    prompt_param: str = "prompt"            # the request field blamed when the prompt is too long
    truncate_prompt_tokens: int | None = None   # vLLM's: keep the prompt's last N tokens (-1: the context)
    cache_salt: str = ""                    # only runs with the same salt share cached prompt prefixes:
                                            # the request's own (vLLM's), after its key's with isolation
    guardrails: list = field(default_factory=list)  # (rule id, action) of the input rules that redacted
    background: bool = False                # a batch line: queued and stepped below every live request


@dataclass(slots=True)
class EmbeddingRequest:
    """One /v1/embeddings request: `texts` (strings) or `ids` (token-id lists), as the schema parsed them."""

    model: str | None = None
    texts: list | None = None
    ids: list | None = None
    dimensions: int | None = None       # None: the model's own
    truncate: int | None = None         # vLLM's truncate_prompt_tokens: keep each input's last N tokens
                                        # (-1: the model's limit); None: over-long inputs are refused
    background: bool = False            # a batch line: below every live request


@dataclass(slots=True)
class EmbeddingResult:
    vectors: list                       # one list of floats per input, in input order
    prompt_tokens: int
    model: str


@dataclass(slots=True)
class ScoreRequest:
    """One /v1/rerank or /v1/score request: (first, second) text pairs, as the schema built them."""

    model: str | None = None
    pairs: list = field(default_factory=list)   # (query, document) or (text_1, text_2) strings
    first_param: str = "query"          # the request field of the first texts, named when one is too long


@dataclass(slots=True)
class ScoreResult:
    scores: list                        # one float per pair, in pair order
    truncated: list                     # one bool per pair: its second text's tail was cut to fit the model
    tokens: int                         # of every pair as scored, special tokens included
    model: str


# PERF(fairness): the inputs of one request go to the compute thread in chunks of at most this many
# inputs and the model's `embed_chunk_tokens` tokens (a decoder runs each input alone, so far fewer
# than an encoder), so generations running beside a long list get their decode steps between chunks.
EMBED_CHUNK = 32


class Service:
    """Admits requests, queues them FIFO and drives the engine on the compute thread."""

    def __init__(self, config, registry=None, queue=None, limits=None, guardrails=None):
        self.config = config
        self.registry = registry if registry is not None else Registry(config)
        self.limits = limits if limits is not None else Limits.from_config(config)
        self.guardrails = guardrails if guardrails is not None else Guardrails.from_config(config)
        self.queue = queue if queue is not None else LockQueue(config.max_waiting, config.queue_timeout,
                                                                        slots=config.max_batch,
                                                                        spare=config.max_paused)
        self.prompts = Prompts(config)
        self.lora = LoraAdmin(self.registry)       # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
        self._loading_pid = None
        self._load_error = None

    def check_room(self, client="", background=False):
        """Overloaded (503 + Retry-After) at once when the queue has no place left for `client`: the
        first step of admission, which the generation routes take before reading the body and `run`
        takes again before resolving the model. `enqueue` stays the definitive check. A background
        request (a batch line) always has a place: it waits below the live ones."""
        if not background:
            self.queue.check_room(client)

    def run(self, req, cancel):
        """Admits `req` now (room, model, tokens, context, queue: ApiError on refusal) and returns a
        lazy `Generation` iterator that waits its turn and then generates."""
        self.prompts.check_without_model(req, self.queue)          # NOTE(order): no model needed, so before resolving one
        # NOTE(overload): a full server refuses before the model is resolved and the prompt rendered
        # and tokenized: that work, sharing the GIL with a busy compute thread, made 503s slow.
        self.check_room(req.client, req.background)
        # NOTE(priority): from here to its first token a live request holds batch lines back
        arrival = None if req.background else priority.live.arrive()
        try:
            lease = self.registry.acquire(req.model)
        except BaseException:
            arrival and arrival.done()
            raise
        # NOTE(lease): a model in use is never unloaded: the generation releases it when it closes
        on_close = (lease.release, lambda: metrics.observe_queue(self.queue)) + ((arrival.done,) if arrival else ())
        try:
            _generating(lease.engine, req.model or self.default_model)
            gen = self._admit(lease.engine, req, cancel, on_close)
        except BaseException:
            lease.release()
            arrival and arrival.done()
            raise
        if arrival is not None:
            gen.on_token(arrival.done)
        metrics.observe_queue(self.queue)
        return gen

    def _admit(self, engine, req, cancel, on_close):
        if req.prompts is not None:
            return self._admit_batch(engine, req, cancel, on_close)
        ids, params, grammar, plan = self.prompts.prepare(engine, req)
        ticket = self.queue.enqueue(cancel, client=req.client, background=req.background)
        return Generation(engine, ids, params, req, cancel, ticket, self.config.keepalive, grammar, plan=plan,
                          time_limit=self.config.max_generation_seconds, on_close=on_close)

    def _admit_batch(self, engine, req, cancel, on_close):
        """A prompt list: every prompt is checked first, then each takes its own queue place and
        runs as its own sequence of the running batch (a PromptBatch drives them side by side)."""
        reqs = [_one_prompt(req, i, p) for i, p in enumerate(req.prompts)]
        prepared = [self.prompts.prepare(engine, r) for r in reqs]
        gens = []
        try:
            for r, (ids, params, grammar, _) in zip(reqs, prepared):
                # NOTE(cancel): each run ends its own token when it closes; the request's token ends them all.
                token = CancelToken()
                cancel.on_cancel(token.cancel)
                ticket = self.queue.enqueue(token, client=req.client, background=req.background)
                gens.append(Generation(engine, ids, params, r, token, ticket, self.config.keepalive, grammar,
                                       poll=True, time_limit=self.config.max_generation_seconds))
        except BaseException:
            for gen in gens:
                gen.close()         # NOTE(overload): a list the queue cannot hold takes no place
            raise
        return PromptBatch(gens, req.n, cancel, self.config.keepalive, on_close)

    @property
    def default_model(self):
        return self.registry.default_name

    def count_tokens(self, req):
        """Prompt tokens `req` would use (template applied), without queueing or generating."""
        return len(self.tokenize(req)[0])

    def models(self):
        return self.registry.list()

    def health(self):
        """{"status": "ok" | "loading" | "error", "model", "backend", "queue": {...}}."""
        engine = self.registry.loaded()
        status = "ok" if engine is not None else ("error" if self._load_error else "loading")
        body = {"status": status, "model": self.registry.default_name,
                "queue": {"waiting": self.queue.depth, "running": self.queue.running,
                          "max_waiting": self.queue.max_waiting}}
        if engine is not None:
            body["backend"] = engine.backend
            body["backend_reason"] = engine.backend_reason
            if getattr(engine, "kernels", ""):
                body["kernels"] = engine.kernels
            body["max_context"] = self.prompts.context(engine)
        elif self._load_error:
            body["error"] = self._load_error
        return body

    def start_loading(self):
        """Loads the default model on a background thread, once per process (call it post-fork)."""
        if self._loading_pid == os.getpid():
            return
        self._loading_pid = os.getpid()
        threading.Thread(target=self._load_default, name="turbospark-load", daemon=True).start()

    def _load_default(self):
        try:
            self.registry.resolve(None)
            self._load_error = None
        except ApiError as e:
            self._load_error = e.message
            log.error("default model not loaded: %s", e.message)
        except Exception:
            self._load_error = "the default model could not be loaded (see the server log)"
            log.exception("loading the default model failed")

    def embed(self, req):
        """An EmbeddingResult for an EmbeddingRequest: the inputs checked, then run through the
        model's encoder on the compute thread (ApiError on refusal)."""
        with self._serving(req.model, "embedding", req.background) as (engine, name):
            if req.dimensions is not None and not engine.matryoshka:
                raise InvalidRequest(f"The model '{name}' does not support 'dimensions' (it declares no "
                                     f"Matryoshka training); it embeds in {engine.dim}", param="dimensions")
            if req.dimensions is not None and req.dimensions > engine.dim:
                raise InvalidRequest(f"'dimensions' is {req.dimensions}; the model '{name}' embeds in "
                                     f"{engine.dim}", param="dimensions")
            keep = None if req.truncate is None else truncation(req.truncate, engine.max_tokens, "input limit")
            seqs = _embedding_ids(engine, req, keep)
            vectors = []
            # NOTE(queue): a place in the same FIFO as generations (503 when it is full), held while
            # the chunks run, so a flood of embeddings waits its turn instead of crowding the compute thread
            with self.queue.slot(background=req.background):
                for chunk in _chunks(seqs, EMBED_CHUNK, engine.embed_chunk_tokens):
                    vectors.extend(compute.run(engine.embed, chunk, req.dimensions).tolist())
            return EmbeddingResult(vectors, sum(len(s) for s in seqs), name)

    def score(self, req):
        """A ScoreResult for a ScoreRequest: every pair through the model's cross-encoder on the
        compute thread, in chunks as `embed`'s, holding a queue place (ApiError on refusal)."""
        with self._serving(req.model, "rerank") as (engine, name):
            try:
                pairs, truncated = engine.encode_pairs(req.pairs)
            except QueryTooLong as e:
                one = len({a for a, _ in req.pairs}) == 1
                where = req.first_param if one else f"{req.first_param}[{e.index}]"
                raise InvalidRequest(f"'{where}' has {e.tokens} tokens; this model scores at most {e.limit} tokens "
                                     f"per pair, special tokens included, which leaves no room for a document",
                                     param=req.first_param, code="context_length_exceeded") from None
            scores = []
            with self.queue.slot():
                for chunk in _chunks(pairs, EMBED_CHUNK, engine.score_chunk_tokens, size=lambda p: len(p[0])):
                    scores.extend(compute.run(engine.score, chunk).tolist())
            return ScoreResult(scores, truncated, sum(len(ids) for ids, _ in pairs), name)

    @contextlib.contextmanager
    def _serving(self, model, capability, background=False):
        """(engine, the name it was asked by) for `model`, leased while the block runs; a 400
        naming the model's kind when it does not serve `capability`, 503 when the queue is full
        (never for a `background` request, a batch line)."""
        self.check_room(background=background)
        name = model or self.default_model
        lease = self.registry.acquire(model)
        try:
            yield _serves(lease.engine, name, capability), name
        finally:
            lease.release()

    def tokenize(self, req):
        """(token ids, max context) for a GenerationRequest's prompt, as `run` would build them."""
        engine = _generating(self.registry.resolve(req.model), req.model or self.default_model)
        if req.prompt == "":
            return encode_text(engine, req), self.prompts.context(engine)
        return self.prompts.ids(engine, req, chat_plan(engine, req)), self.prompts.context(engine)

    def tokenizer_info(self, model):
        """What the tokenizer of `model` (resolving it) is: its special tokens, BOS rule, chat
        template and context, for vLLM's GET /tokenizer_info."""
        engine = _generating(self.registry.resolve(model), model or self.default_model)
        tokenizer = engine.tokenizer
        return TokenizerInfo(bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, add_bos=engine.add_bos,
                             chat_template=template_source(engine), max_context=self.prompts.context(engine))

    def detokenize(self, model, ids):
        """The text of token ids (special tokens kept), checked against the vocabulary."""
        engine = _generating(self.registry.resolve(model), model or self.default_model)
        check_ids(engine.config.vocab_size, ids, "tokens")
        return engine.decode(list(ids), skip_special=False)

@dataclass(slots=True)
class TokenizerInfo:
    bos_token: str | None
    eos_token: str | None
    add_bos: bool                           # raw text gets BOS (the model's own rule)
    chat_template: str
    max_context: int


# what a model of each kind does not do (its error code and words), and the routes that serve it
_REFUSALS = {"generation": ("model_not_generative", "does not generate text"),
             "embedding": ("model_not_embedding", "does not embed"),
             "rerank": ("model_not_reranker", "does not rerank (it is no cross-encoder)")}
_ROUTES = {"generation": "the completion and chat routes", "embedding": "/v1/embeddings",
           "rerank": "/v1/rerank and /v1/score"}


def _serves(engine, name, capability):
    """`engine`, when it serves `capability`; a 400 naming the model's kind and its routes otherwise."""
    if capability not in engine.capabilities:
        code, words = _REFUSALS[capability]
        kind = engine.kind
        routes = _ROUTES.get(kind, "its own routes")
        raise InvalidRequest(f"The model '{name}' is {'an' if kind == 'embedding' else 'a'} {kind} model and "
                             f"{words}; use it with {routes}, or another model (see GET /v1/models)",
                             param="model", code=code)
    return engine


def _generating(engine, name):
    return _serves(engine, name, "generation")


def _chunks(seqs, most, tokens, size=len):
    """`seqs` in order, in runs of at most `most` sequences and `tokens` tokens by `size` (at least
    one each)."""
    run, total = [], 0
    for s in seqs:
        if run and (len(run) == most or total + size(s) > tokens):
            yield run
            run, total = [], 0
        run.append(s)
        total += size(s)
    if run:
        yield run


def _embedding_ids(engine, req, keep=None):
    """Token ids of every input, each checked: not empty, inside the vocabulary, within the
    model's limit (an input over it is refused unless `keep`, truncate_prompt_tokens, cuts it)."""
    seqs = engine.encode_batch(req.texts) if req.texts is not None else [list(s) for s in req.ids]
    if keep is not None:
        head, tail = engine.special_span if req.texts is not None else (0, 0)
        seqs = [keep_last(s, keep, head, tail) for s in seqs]
    for i, ids in enumerate(seqs):
        where = f"input[{i}]" if len(seqs) > 1 or req.texts is None else "input"
        if req.ids is not None:
            if not ids:
                raise InvalidRequest(f"{where} holds no token ids", param="input")
            check_ids(engine.vocab_size, ids, "input", where)
        if len(ids) > engine.max_tokens:
            raise InvalidRequest(f"{where} has {len(ids)} tokens; this model embeds at most {engine.max_tokens} "
                                 f"tokens per input (truncate_prompt_tokens keeps the last N)", param="input",
                                 code="context_length_exceeded")
    return seqs


def _one_prompt(req, i, prompt):
    text = isinstance(prompt, str)
    return dataclasses.replace(req, prompts=None, prompt=prompt if text else None,
                               prompt_ids=None if text else prompt, prompt_param=f"prompt[{i}]")



