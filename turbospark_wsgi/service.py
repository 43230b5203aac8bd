"""The seam between HTTP and the engine: eager admission, then lazy generation as service events.

    events = service.run(GenerationRequest(...), CancelToken())   # ApiError here: nothing sent yet
    for event in events:       # KeepAlive | TextDelta | Finished; ends without Finished if cancelled
        ...
    events.close()             # idempotent: cancels, stops the engine, releases the queue slot
"""
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from . import compute, metrics
from .cancel import CancelToken
from .engine import SamplingParams
from .errors import ApiError, ContextLengthExceeded, InvalidRequest, Overloaded
from .generation import Generation, PromptBatch
from .limits import Limits
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
    chat: object = None                     # a schemas.tool_prompt.ChatPart: messages through the model's
                                            # template, planned against it by `chat.plan(source)`
    prompts: list | None = None             # completions: several prompts, each text or token ids
    add_special: bool = True                # raw text: BOS where the model's own rule puts one; False: never
    max_tokens: int | None = 16             # None: up to the end of the context
    params: SamplingParams = field(default_factory=SamplingParams)
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


@dataclass(slots=True)
class EmbeddingRequest:
    """One /v1/embeddings request: `texts` (strings) or `ids` (token-id lists), as the schema parsed them."""

    model: str | None = None
    texts: list | None = None
    ids: list | None = None
    dimensions: int | None = None       # None: the model's own
    truncate: int | None = None         # vLLM's truncate_prompt_tokens: keep each input's last N tokens
                                        # (-1: the model's limit); None: over-long inputs are refused


@dataclass(slots=True)
class EmbeddingResult:
    vectors: list                       # one list of floats per input, in input order
    prompt_tokens: int
    model: str


# PERF(fairness): the inputs of one request go to the compute thread in chunks of at most this many
# inputs and the model's `embed_chunk_tokens` tokens (a decoder runs each input alone, so far fewer
# than an encoder), so generations running beside a long list get their decode steps between chunks.
EMBED_CHUNK = 32


class Service:
    """Admits requests, queues them FIFO and drives the engine on the compute thread."""

    def __init__(self, config, registry=None, queue=None, limits=None):
        self.config = config
        self.registry = registry if registry is not None else Registry(config)
        self.limits = limits if limits is not None else Limits.from_config(config)
        self.queue = queue if queue is not None else LockQueue(config.max_waiting, config.queue_timeout,
                                                                        slots=config.max_batch,
                                                                        spare=config.max_paused)
        self._loading_pid = None
        self._load_error = None

    def check_room(self, client=""):
        """Overloaded (503 + Retry-After) at once when the queue has no place left for `client`: the
        first step of admission, which the generation routes take before reading the body and `run`
        takes again before resolving the model. `enqueue` stays the definitive check."""
        self.queue.check_room(client)

    def run(self, req, cancel):
        """Admits `req` now (room, model, tokens, context, queue: ApiError on refusal) and returns a
        lazy `Generation` iterator that waits its turn and then generates."""
        self._check_without_model(req)          # NOTE(order): no model needed, so before resolving one
        # NOTE(overload): a full server refuses before the model is resolved and the prompt rendered
        # and tokenized: that work, sharing the GIL with a busy compute thread, made 503s slow.
        self.queue.check_room(req.client)
        lease = self.registry.acquire(req.model)
        # NOTE(lease): a model in use is never unloaded: the generation releases it when it closes
        on_close = (lease.release, lambda: metrics.observe_queue(self.queue))
        try:
            _generating(lease.engine, req.model or self.default_model)
            gen = self._admit(lease.engine, req, cancel, on_close)
        except BaseException:
            lease.release()
            raise
        metrics.observe_queue(self.queue)
        return gen

    def _admit(self, engine, req, cancel, on_close):
        if req.prompts is not None:
            return self._admit_batch(engine, req, cancel, on_close)
        ids, params, grammar, plan = self._prepare(engine, req)
        ticket = self.queue.enqueue(cancel, client=req.client)
        return Generation(engine, ids, params, req, cancel, ticket, self.config.keepalive, grammar, plan=plan,
                          time_limit=self.config.max_generation_seconds, on_close=on_close)

    def _prepare(self, engine, req):
        """(prompt ids, sampling params, compiled grammar or None, the chat's OutputPlan or None)."""
        plan = req.chat.plan(_template_source(engine)) if req.chat is not None else None
        ids = self._prompt_ids(engine, req, plan)
        params = dataclasses.replace(req.params, max_new_tokens=self._budget(engine, req, len(ids)),
                                     logprobs=_logprobs_wanted(req))
        self._check_logit_bias(engine, params)
        return ids, params, self._grammar(engine, plan), plan

    def _admit_batch(self, engine, req, cancel, on_close):
        """A prompt list: every prompt is checked first, then each takes its own queue place and
        runs as its own sequence of the running batch (a PromptBatch drives them side by side)."""
        reqs = [_one_prompt(req, i, p) for i, p in enumerate(req.prompts)]
        prepared = [self._prepare(engine, r) for r in reqs]
        gens = []
        try:
            for r, (ids, params, grammar, _) in zip(reqs, prepared):
                # NOTE(cancel): each run ends its own token when it closes; the request's token ends them all.
                token = CancelToken()
                cancel.on_cancel(token.cancel)
                ticket = self.queue.enqueue(token, client=req.client)
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
            body["max_context"] = self._context(engine)
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

    def _prompt_ids(self, engine, req, plan=None):
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            _check_ids(engine.config.vocab_size, ids, req.prompt_param)
        elif plan is not None:
            try:
                # NOTE(kwargs): one dict, never **-spread: a key named like a parameter is the engine's to refuse.
                ids = engine.apply_chat_template(plan.messages, tools=plan.tools,
                                                 template_kwargs=req.chat.template_kwargs)
            except ValueError as e:
                raise InvalidRequest(str(e), param=getattr(e, "param", None) or "messages") from e
            if plan.assistant_prefix:
                # NOTE(prefix): the forced tool-call opening is server markup (Mistral's [TOOL_CALLS] is a
                # control token); the only client text in it is a tool name, checked to [A-Za-z0-9_.-].
                ids = ids + engine.encode(plan.assistant_prefix, add_bos=False)
        else:
            ids = _encode_text(engine, req)
        if not ids:
            raise InvalidRequest("the prompt is empty", param=req.prompt_param)
        if req.truncate_prompt_tokens is not None:
            keep = _truncation(req.truncate_prompt_tokens, self._context(engine), "context length")
            bos = req.prompt is not None and req.add_special and engine.add_bos
            ids = keep_last(ids, keep, head=int(bos))
        return ids

    def _context(self, engine):
        cap = self.config.max_context
        return min(engine.max_context, cap) if cap else engine.max_context

    def _budget(self, engine, req, n_prompt):
        ctx = self._context(engine)
        if n_prompt + 1 > ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens, but the prompt has {n_prompt} "
                f"tokens, which leaves no room for a completion. Please shorten the prompt.",
                param=req.prompt_param)
        cap = self.config.max_prompt_tokens
        if cap and n_prompt > cap:
            raise InvalidRequest(f"The prompt has {n_prompt} tokens; this server accepts at most {cap} "
                                 f"(TURBOSPARK_MAX_PROMPT_TOKENS)", param=req.prompt_param, code="prompt_too_long")
        if req.max_tokens is None:
            return min(ctx - n_prompt, self.config.max_tokens_cap or ctx)
        if req.max_tokens == 0:             # echo only: score the prompt, generate nothing
            return 0
        if n_prompt + req.max_tokens > ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{n_prompt + req.max_tokens} tokens ({n_prompt} in the prompt, {req.max_tokens} for "
                f"the completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens")
        return req.max_tokens

    def _grammar(self, engine, plan):
        if plan is None or plan.grammar is None:
            return None
        # NOTE(grammar): compiled aside, never on the compute thread (a client's schema may take
        # seconds), within TURBOSPARK_GRAMMAR_TIMEOUT; a compile past it runs on to its end aside.
        # NOTE(aside-busy): the limit counts the compile's own time. Other clients' compiles that ran
        # past their limit still hold the pool; a grammar that never got a compiler in time is the
        # server's 503, not this client's 400.
        begun = []
        job = compute.aside(_timed, begun, engine.compile_grammar, plan.grammar)
        limit = self.config.grammar_timeout
        try:
            try:
                return job.result(timeout=limit)
            except TimeoutError:
                if not begun and job.cancel():      # not started: it never will
                    raise Overloaded("every grammar compiler is busy with other requests' schemas; retry",
                                     retry_after=max(1, round(limit))) from None
                waited = time.monotonic() - begun[0] if begun else 0.0
                return job.result(timeout=max(0.0, limit - waited))
        except TimeoutError:
            raise InvalidRequest(f"'{plan.grammar_param}' took longer than {limit:g} s to compile into a grammar; "
                                 f"simplify the schema", param=plan.grammar_param) from None
        except ValueError as e:
            raise InvalidRequest(f"'{plan.grammar_param}' cannot be enforced: {e}", param=plan.grammar_param) from e

    def embed(self, req):
        """An EmbeddingResult for an EmbeddingRequest: the inputs checked, then run through the
        model's encoder on the compute thread (ApiError on refusal)."""
        self.queue.check_room()
        name = req.model or self.default_model
        lease = self.registry.acquire(req.model)
        try:
            engine = lease.engine
            if "embedding" not in engine.capabilities:
                raise InvalidRequest(f"The model '{name}' is a generation model and does not embed; "
                                     f"use an embedding model (see GET /v1/models)", param="model",
                                     code="model_not_embedding")
            if req.dimensions is not None and not engine.matryoshka:
                raise InvalidRequest(f"The model '{name}' does not support 'dimensions' (it declares no "
                                     f"Matryoshka training); it embeds in {engine.dim}", param="dimensions")
            if req.dimensions is not None and req.dimensions > engine.dim:
                raise InvalidRequest(f"'dimensions' is {req.dimensions}; the model '{name}' embeds in "
                                     f"{engine.dim}", param="dimensions")
            keep = None if req.truncate is None else _truncation(req.truncate, engine.max_tokens, "input limit")
            seqs = _embedding_ids(engine, req, keep)
            vectors = []
            # NOTE(queue): a place in the same FIFO as generations (503 when it is full), held while
            # the chunks run, so a flood of embeddings waits its turn instead of crowding the compute thread
            with self.queue.slot():
                for chunk in _chunks(seqs, EMBED_CHUNK, engine.embed_chunk_tokens):
                    vectors.extend(compute.run(engine.embed, chunk, req.dimensions).tolist())
            return EmbeddingResult(vectors, sum(len(s) for s in seqs), name)
        finally:
            lease.release()

    def tokenize(self, req):
        """(token ids, max context) for a GenerationRequest's prompt, as `run` would build them."""
        engine = _generating(self.registry.resolve(req.model), req.model or self.default_model)
        if req.prompt == "":
            return _encode_text(engine, req), self._context(engine)
        plan = req.chat.plan(_template_source(engine)) if req.chat is not None else None
        return self._prompt_ids(engine, req, plan), self._context(engine)

    def tokenizer_info(self, model):
        """What the tokenizer of `model` (resolving it) is: its special tokens, BOS rule, chat
        template and context, for vLLM's GET /tokenizer_info."""
        engine = _generating(self.registry.resolve(model), model or self.default_model)
        tokenizer = engine.tokenizer
        return TokenizerInfo(bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, add_bos=engine.add_bos,
                             chat_template=_template_source(engine), max_context=self._context(engine))

    def detokenize(self, model, ids):
        """The text of token ids (special tokens kept), checked against the vocabulary."""
        engine = _generating(self.registry.resolve(model), model or self.default_model)
        _check_ids(engine.config.vocab_size, ids, "tokens")
        return engine.decode(list(ids), skip_special=False)

    def _check_without_model(self, req):
        """The server's limits a request can be held to before any model is resolved."""
        cap = self.config.max_tokens_cap
        if cap and req.max_tokens is not None and req.max_tokens > cap:
            raise InvalidRequest(f"max_tokens is {req.max_tokens}; this server allows at most {cap} "
                                 f"(TURBOSPARK_MAX_TOKENS_CAP)", param="max_tokens", code="max_tokens_too_large")
        room = self.queue.slots + self.queue.max_waiting
        if req.prompts is not None and len(req.prompts) > room:
            raise InvalidRequest(f"'prompt' holds {len(req.prompts)} prompts; this server runs or queues at most "
                                 f"{room} at once (TURBOSPARK_MAX_BATCH + TURBOSPARK_MAX_WAITING)", param="prompt")

    def _check_logit_bias(self, engine, params):
        vocab = engine.config.vocab_size
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})",
                                 param="logit_bias")


@dataclass(slots=True)
class TokenizerInfo:
    bos_token: str | None
    eos_token: str | None
    add_bos: bool                           # raw text gets BOS (the model's own rule)
    chat_template: str
    max_context: int


def _generating(engine, name):
    """`engine`, when it generates; a 400 naming the model's kind when it only embeds."""
    if "generation" not in engine.capabilities:
        raise InvalidRequest(f"The model '{name}' is an embedding model and does not generate text; "
                             f"use it with /v1/embeddings", param="model", code="model_not_generative")
    return engine


def _chunks(seqs, most, tokens):
    """`seqs` in order, in runs of at most `most` sequences and `tokens` tokens (at least one each)."""
    run, size = [], 0
    for s in seqs:
        if run and (len(run) == most or size + len(s) > tokens):
            yield run
            run, size = [], 0
        run.append(s)
        size += len(s)
    if run:
        yield run


def _truncation(value, limit, what):
    """The number of tokens `truncate_prompt_tokens` keeps: -1 is the model's limit; more than the
    limit is a 400, as in vLLM."""
    if value > limit:
        raise InvalidRequest(f"'truncate_prompt_tokens' is {value}; this model's {what} is {limit} tokens",
                             param="truncate_prompt_tokens")
    return limit if value < 0 else value


def keep_last(ids, n, head=0, tail=0):
    """The last `n` tokens of `ids` (vLLM's left truncation), keeping the `head` leading and `tail`
    trailing special tokens the tokenizer added (BOS, [CLS] ... [SEP]) as the tokenizer's own
    truncation does, where they leave room for at least one token of the text."""
    if len(ids) <= n:
        return list(ids)
    if n <= head + tail:
        return list(ids[-n:])
    end = len(ids) - tail
    return list(ids[:head]) + list(ids[end - (n - head - tail):end]) + list(ids[end:])


def _template_source(engine):
    """The chat template source of a generating engine."""
    return engine.template.source


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
            _check_ids(engine.vocab_size, ids, "input", where)
        if len(ids) > engine.max_tokens:
            raise InvalidRequest(f"{where} has {len(ids)} tokens; this model embeds at most {engine.max_tokens} "
                                 f"tokens per input (truncate_prompt_tokens keeps the last N)", param="input",
                                 code="context_length_exceeded")
    return seqs


def _encode_text(engine, req):
    # NOTE(bos): llama.cpp's add_special: BOS only where the model asks for it (SmolLM2's GGUF says
    # add_bos_token = false), so a text prompt and the same text's token ids score alike.
    return engine.encode(req.prompt or "", add_bos=req.add_special and engine.add_bos)


def _one_prompt(req, i, prompt):
    text = isinstance(prompt, str)
    return dataclasses.replace(req, prompts=None, prompt=prompt if text else None,
                               prompt_ids=None if text else prompt, prompt_param=f"prompt[{i}]")


def _check_ids(vocab, ids, param, where=""):
    """InvalidRequest naming `param` (and `where`, the input it is in) for an id outside 0..vocab-1."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"{where + ': ' if where else ''}token id {bad} is outside the vocabulary "
                             f"(0..{vocab - 1})", param=param)


def _logprobs_wanted(req):
    if req.logprobs is not None:
        return req.logprobs
    return 0 if (req.best_of or 0) > req.n else None      # best_of ranks by cumulative logprob


def _timed(begun, fn, *args):
    """fn(*args), noting in `begun` when it started."""
    begun.append(time.monotonic())
    return fn(*args)
