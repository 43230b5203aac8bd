"""What a generation request becomes before it queues: prompt ids within the model's context and
the server's caps, its sampling params (built once the token budget is known), and the chat's
output plan with its grammar compiled aside. Each step refuses with an ApiError that names the
request field at fault.

    prompts = Prompts(config)
    prompts.check_without_model(req, queue)                 # caps that need no model
    ids, params, grammar, plan = prompts.prepare(engine, req)
"""
import time

from ..errors import ContextLengthExceeded, InvalidRequest, Overloaded
from . import compute
from .chat_plan import plan_output
from .params import logprobs_wanted, sampling_params


class Prompts:
    """The server's prompt and budget rules (TURBOSPARK_MAX_CONTEXT, _MAX_PROMPT_TOKENS,
    _MAX_TOKENS_CAP, _GRAMMAR_TIMEOUT) applied to one request and engine."""

    def __init__(self, config):
        self.config = config

    def prepare(self, engine, req):
        """(prompt ids, sampling params, compiled grammar or None, the chat's OutputPlan or None)."""
        plan = chat_plan(engine, req)
        if req.chat is not None and req.chat.thinking_budget is None:
            # NOTE(budget): an effort's budget, else the model's default (TURBOSPARK_REASONING_BUDGET[S])
            req.chat.thinking_budget = self.config.reasoning_budget_for(req.chat.reasoning_effort,
                                                                      req.model or self.config.model)
        ids = self.ids(engine, req, plan)
        params = sampling_params(req.sampling, self.budget(engine, req, len(ids)), logprobs_wanted(req))
        self.check_logit_bias(engine, params)
        return ids, params, self.grammar(engine, plan), plan

    def ids(self, engine, req, plan=None):
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            check_ids(engine.config.vocab_size, ids, req.prompt_param)
        elif plan is not None:
            try:
                # NOTE(kwargs): one dict, never **-spread: a key named like a parameter is the engine's to refuse.
                # NOTE(template): the model's template is code from its file, rendered within its budget
                # (engine/template_budget.py) and off gevent's hub, so a slow one delays only this request.
                ids = compute.off_hub(engine.apply_chat_template, plan.messages, tools=plan.tools,
                                      template_kwargs=req.chat.template_kwargs)
            except ValueError as e:
                raise InvalidRequest(str(e), param=getattr(e, "param", None) or "messages",
                                     code=getattr(e, "code", None)) from e
            if plan.assistant_prefix:
                # NOTE(prefix): the forced tool-call opening is server markup (Mistral's [TOOL_CALLS] is a
                # control token); the only client text in it is a tool name, checked to [A-Za-z0-9_.-].
                ids = ids + engine.encode(plan.assistant_prefix, add_bos=False)
        else:
            ids = encode_text(engine, req)
        if not ids:
            raise InvalidRequest("the prompt is empty", param=req.prompt_param)
        if req.truncate_prompt_tokens is not None:
            keep = truncation(req.truncate_prompt_tokens, self.context(engine), "context length")
            bos = req.prompt is not None and req.add_special and engine.add_bos
            ids = keep_last(ids, keep, head=int(bos))
        return ids

    def context(self, engine):
        cap = self.config.max_context
        return min(engine.max_context, cap) if cap else engine.max_context

    def budget(self, engine, req, n_prompt):
        ctx = self.context(engine)
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

    def grammar(self, engine, plan):
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

    def check_without_model(self, req, queue):
        """The server's limits a request can be held to before any model is resolved."""
        cap = self.config.max_tokens_cap
        if cap and req.max_tokens is not None and req.max_tokens > cap:
            raise InvalidRequest(f"max_tokens is {req.max_tokens}; this server allows at most {cap} "
                                 f"(TURBOSPARK_MAX_TOKENS_CAP)", param="max_tokens", code="max_tokens_too_large")
        room = queue.slots + queue.max_waiting
        if req.prompts is not None and len(req.prompts) > room:
            raise InvalidRequest(f"'prompt' holds {len(req.prompts)} prompts; this server runs or queues at most "
                                 f"{room} at once (TURBOSPARK_MAX_BATCH + TURBOSPARK_MAX_WAITING)", param="prompt")

    def check_logit_bias(self, engine, params):
        vocab = engine.config.vocab_size
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})",
                                 param="logit_bias")


def truncation(value, limit, what):
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


def template_source(engine):
    """The chat template source of a generating engine."""
    return engine.template.source


def chat_plan(engine, req):
    """The OutputPlan of a chat request against the engine's template; None for a raw prompt."""
    return plan_output(template_source(engine), req.chat) if req.chat is not None else None


def encode_text(engine, req):
    # NOTE(bos): llama.cpp's add_special: BOS only where the model asks for it (SmolLM2's GGUF says
    # add_bos_token = false), so a text prompt and the same text's token ids score alike.
    return engine.encode(req.prompt or "", add_bos=req.add_special and engine.add_bos)


def check_ids(vocab, ids, param, where=""):
    """InvalidRequest naming `param` (and `where`, the input it is in) for an id outside 0..vocab-1."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"{where + ': ' if where else ''}token id {bad} is outside the vocabulary "
                             f"(0..{vocab - 1})", param=param)


def _timed(begun, fn, *args):
    """fn(*args), noting in `begun` when it started."""
    begun.append(time.monotonic())
    return fn(*args)
