"""Engine: one loaded model, its tokenizer and chat template, and the scheduler that batches its runs
over a prefix cache of up to `max_batch` + `max_paused` KV caches."""
import os
from pathlib import Path

import numpy as np

from .chat_template import ARCH_TEMPLATES, ChatTemplate, template_limits
from .constraints import ConstraintCompiler, ThinkingBudget, ThinkThenGrammar
from .draft import load_draft
from .encoder import normalize
from .events import Finish
from .scheduler import Scheduler
from .speculative import ROW_COST, SpeculativeOptions
from .gguf import read_metadata
from .loader import load_model
from .options import EngineOptions, resolve
from .tokenizer import Tokenizer

# GGUF `<arch>.pooling_type` values (llama.cpp's enum) that pool a sequence into one vector
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}
# PERF(embed): an input runs through the model in pieces of at most this many tokens
EMBED_PIECE = 512


def load_engine(path, options=None, *, name=None, **overrides):
    """Loads a .gguf file or a Hugging Face directory as `options` (an EngineOptions; keyword
    `overrides` replace its fields: device="cpu", max_batch=4, ...); errors name the file and the problem."""
    options = resolve(options, overrides)
    loaded = load_model(path, options)
    if loaded.kind == "gguf":
        tokenizer = Tokenizer.from_gguf_metadata(loaded.metadata)
    else:
        tokenizer = Tokenizer.from_hf_dir(path)
    return Engine(loaded, tokenizer, options, name=name)


def chat_template_status(path):
    """What a generation model's chat template does under the load's probe, read from its files
    without loading the weights: "chat template: ok", "chat template refused: <why>", or "" where
    the files cannot say (unreadable, no tokenizer)."""
    try:
        if os.path.isfile(path):
            meta = read_metadata(path)
            tokenizer, arch = Tokenizer.from_gguf_metadata(meta), meta.get("general.architecture")
        else:
            tokenizer, arch = Tokenizer.from_hf_dir(path), None
    except (OSError, ValueError, KeyError):
        return ""
    template = ChatTemplate.checked(tokenizer.chat_template or ARCH_TEMPLATES.get(arch), tokenizer.bos_token,
                                    tokenizer.eos_token, tokenizer.special_tokens, name=f"model '{_model_id(path)}'")
    return "chat template: ok" if template.problem is None else f"chat template refused: {template.problem}"


class Engine:
    """A generation model (protocol.TextEngine) that embeds too (protocol.EmbeddingEngine): its
    final-normed hidden states, pooled."""

    kind = "generation"
    capabilities = ("generation", "embedding")
    matryoshka = False
    embed_chunk_tokens = EMBED_PIECE        # tokens of inputs one compute-thread call embeds

    def __init__(self, loaded, tokenizer, options=None, *, name=None):
        options = options or EngineOptions()
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.tokenizer = tokenizer
        self.name = name or _model_id(loaded.path)
        self.backend, self.backend_reason = loaded.backend, loaded.backend_reason
        self.kernels = loaded.kernels          # the CPU kernels it runs and why ("" on a GPU)
        cap = self.config.max_seq_len
        self.max_context = min(cap, options.max_context) if options.max_context else cap
        self.prefill_chunk = options.prefill_chunk
        # NOTE(template): no template shipped means the architecture's own (Gemma 3), else ChatML. It is
        # the model file's code: probed here under its render budget, and refused (chat routes off,
        # `template.problem` says why) when it fails.
        self.template = ChatTemplate.checked(tokenizer.chat_template or ARCH_TEMPLATES.get(self.config.arch),
                                             tokenizer.bos_token, tokenizer.eos_token, tokenizer.special_tokens,
                                             limits=template_limits(self.max_context), name=f"model '{self.name}'")
        self._constraints = ConstraintCompiler(tokenizer, self.config.vocab_size)
        self.max_batch = options.max_batch
        self.pooling = _pooling(loaded)
        speculative = SpeculativeOptions(options.speculative, options.speculative_tokens,
                                         row_cost=ROW_COST.get(self.backend, ROW_COST["numpy"]))
        self.draft = load_draft(options.draft_model, options, tokenizer, self.model) if options.draft_model else None
        self.scheduler = Scheduler(self.model, tokenizer, max_batch=self.max_batch, max_paused=options.max_paused,
                                   max_context=self.max_context, chunk=self.prefill_chunk, speculative=speculative,
                                   draft=self.draft)

    @property
    def add_bos(self):
        """Whether the model puts BOS before a raw text prompt (GGUF `tokenizer.ggml.add_bos_token`,
        or the Hugging Face tokenizer's `add_bos_token` / post-processor): llama.cpp's add_special."""
        return self.tokenizer.add_bos and self.tokenizer.bos_id is not None

    # ---- embeddings (the attributes /v1/embeddings reads, as on the encoder) -------------------------

    @property
    def dim(self):
        return self.config.dim

    @property
    def vocab_size(self):
        return self.config.vocab_size

    @property
    def max_tokens(self):
        return self.max_context

    @property
    def special_span(self):
        """(leading, trailing) special tokens `encode_batch` puts around a text: BOS where the model wants it."""
        return int(self.add_bos), 0

    def encode_batch(self, texts):
        """Token ids of texts to embed, with BOS where the model wants it (llama.cpp's add_special)."""
        return [self.encode(t, add_bos=self.add_bos) for t in texts]

    def embed(self, sequences, dimensions=None):
        """float32 [len(sequences), dim]: each token-id list (1..max_context ids in the vocabulary:
        the caller checks) run alone through the model, its final-normed hidden states (what the
        head reads) pooled as `pooling` says and scaled to unit length. `dimensions` is not
        supported (no Matryoshka training) and must be None.

        NOTE(isolation): every input gets a fresh KV cache of its own size, never a prefix-cache
        slot, so running generations keep their caches; call it on the compute thread, between
        their steps.

        NOTE(precision): with the float32 kernels, whatever TURBOSPARK_ACTIVATIONS says for generation.
        int8 activations moved SmolLM2-135M's vectors to cosine 0.9967 of the float32 ones (median
        0.9992) and changed a nearest-neighbour ranking; float32 equals transformers' (cosine 1.0)."""
        from .kernels import cpu as kernels_cpu
        out = np.empty((len(sequences), self.dim), dtype=np.float32)
        with kernels_cpu.activations_as("float32"):
            for row, ids in enumerate(sequences):
                cache = self.model.new_cache(max_seq=len(ids))
                hidden = np.concatenate([self.model.forward(ids[i:i + EMBED_PIECE], cache, logits="hidden")
                                         for i in range(0, len(ids), EMBED_PIECE)])          # [T, dim]
                out[row] = hidden.mean(axis=0) if self.pooling == "mean" else \
                    hidden[0 if self.pooling == "cls" else -1]
        return normalize(out).astype(np.float32)

    # ---- generation ----------------------------------------------------------------------------------

    def encode(self, text, add_bos):
        return self.tokenizer.encode(text, add_bos=add_bos)

    def decode(self, ids, skip_special=True):
        return self.tokenizer.decode(ids, skip_special=skip_special)

    def render_chat(self, messages, tools=None, add_generation_prompt=True, template_kwargs=None):
        return self.template.render_guarded(messages, tools, add_generation_prompt, template_kwargs)[0]

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, template_kwargs=None):
        """Prompt ids of a conversation. Special-token strings in client values (messages, tools,
        template_kwargs) are tokenized as text: only the template's own markup is control tokens."""
        # NOTE(bos): templates usually emit their own BOS; add one only where the model wants it and
        # the rendered text does not already start with it.
        text, plain = self.template.render_guarded(messages, tools, add_generation_prompt, template_kwargs)
        return self.tokenizer.encode(text, add_bos=self.tokenizer.add_bos, plain=plain)

    def compile_grammar(self, grammar):
        """A compiled grammar (`.start()` -> a Constraint, a run's `constraint`); ValueError
        naming the problem when the spec (llguidance JSON grammar format) cannot compile."""
        return self._constraints.compile(grammar)

    def thinking_budget(self, budget, prompt_ids, open_tag="<think>", close_tag="</think>", then=None):
        """A constraint (a run's `constraint`) that closes the think tag after `budget`
        reasoning tokens of the run that continues `prompt_ids`; `then`: a grammar's Constraint that
        governs the reply after the think block (ThinkThenGrammar)."""
        budget = ThinkingBudget(budget, self.encode(open_tag, add_bos=False), self.encode(close_tag, add_bos=False),
                                prompt_ids, self.config.vocab_size)
        return budget if then is None else ThinkThenGrammar(budget, then)

    def generate(self, prompt_ids, params, should_stop=None, client="", cache_salt="", background=False, adapter=None,
                 constraint=None, choice=0):
        """Events for one run (see engine/__init__). Runs that are alive at the same time share
        decode steps, the batch's rows shared fairly between `client`s; one `next()` runs at most
        one step when no event is waiting. Only runs with the same `cache_salt` (and `adapter`)
        share cached prompt prefixes. A `background` run (a batch line) steps only where no other
        run needs the step (see scheduler.Scheduler._batch). `adapter`: a LoraAdapter from
        `load_adapter` the run adds to the model, or None; runs of any adapters share steps.
        `constraint`: this run's (compile_grammar's `.start()`, thinking_budget), or None; `choice`:
        which of its request's runs this is (n, best_of), so a seeded run draws from seed + choice."""
        prompt_ids = [int(t) for t in prompt_ids]
        self._check_prompt(prompt_ids)
        return self.drive(self.scheduler.add(prompt_ids, params, should_stop, client, cache_salt, background, adapter,
                                               constraint, choice))

    def score(self, prompt_ids, top=0, should_stop=None, client="", cache_salt="", background=False, adapter=None):
        """Events that score the prompt: Prefill progress and Scores (the log-probability of every
        prompt token given the ones before it, the first None), then Finish. Like `generate`, one
        `next()` runs at most one step, shared with the other runs, and `should_stop` cancels it."""
        prompt_ids = [int(t) for t in prompt_ids]
        self._check_prompt(prompt_ids)
        return self.drive(self.scheduler.add_scoring(prompt_ids, top, should_stop, client, cache_salt, background,
                                                       adapter))

    def load_adapter(self, directory, name, max_rank):
        """A LoraAdapter (lora.py) for this model from the PEFT directory `directory`, named `name`;
        ValueError (lora.AdapterError) naming the problem where it does not fit this model."""
        from .lora import load_adapter
        return load_adapter(directory, name, self.config, self.model, max_rank)

    def with_adapter(self, adapter):
        """This engine as a generation engine that runs LoRA `adapter` (AdapterEngine)."""
        return AdapterEngine(self, adapter)

    def drive(self, seq):
        """The events of sequence `seq` until its Finish; each `next()` is Scheduler.poll's, so it
        runs one step (for every sequence in the batch) only when `seq` has no event waiting. Closing
        it releases the sequence's slot. serving/steps.py states the whole loop, request to kernel."""
        try:
            while True:
                for event in self.scheduler.poll(seq):
                    yield event
                    if isinstance(event, Finish):
                        return
        finally:
            self.scheduler.release(seq)

    def _check_prompt(self, ids):
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) + 1 > self.max_context:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.max_context}")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")


class AdapterEngine:
    """A base Engine serving one LoRA adapter: its runs go to the base's scheduler with the adapter
    (so they batch with the base's and other adapters' runs); everything else is the base's. It
    generates and scores only: embeddings are the base model's own."""

    kind = "generation"
    capabilities = ("generation",)

    def __init__(self, base, adapter):
        self.base, self.adapter, self.name = base, adapter, adapter.name

    def generate(self, prompt_ids, params, *args, **kw):
        return self.base.generate(prompt_ids, params, *args, adapter=self.adapter, **kw)

    def score(self, prompt_ids, *args, **kw):
        return self.base.score(prompt_ids, *args, adapter=self.adapter, **kw)

    def __getattr__(self, name):
        return getattr(self.base, name)


def _pooling(loaded):
    """How hidden states pool into one vector: the GGUF's own `<arch>.pooling_type` where it names
    mean, CLS or last; otherwise mean.

    NOTE(pooling): llama.cpp's default for a GGUF without the key is "none" (a vector per token);
    its OpenAI route then refuses ("Pooling type 'none' is not OAI compatible"), so there is no
    default to copy. Mean is what `llama-server --embeddings --pooling mean` computes; for a model
    not trained to embed it keeps every token's say, where the last token mostly predicts the next."""
    meta = loaded.metadata if loaded.kind == "gguf" else {}
    return POOLING_TYPES.get(meta.get(f"{meta.get('general.architecture')}.pooling_type"), "mean")


def _model_id(path):
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name
