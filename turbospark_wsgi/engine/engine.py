"""Engine: one loaded model, its tokenizer and chat template, and one KV cache with prefix reuse."""
from pathlib import Path

from .chat_template import ChatTemplate
from .constraints import ConstraintCompiler
from .generate import Generation
from .loader import load_model
from .sampling import log_softmax, top_n
from .tokenizer import Tokenizer

DEFAULT_PREFILL_CHUNK = 256


def load_engine(path, device="auto", *, name=None, max_context=0, prefill_chunk=DEFAULT_PREFILL_CHUNK):
    """Loads a .gguf file or a Hugging Face directory; errors name the file and the problem."""
    loaded = load_model(path, device=device)
    if loaded.kind == "gguf":
        tokenizer = Tokenizer.from_gguf_metadata(loaded.metadata)
    else:
        tokenizer = Tokenizer.from_hf_dir(path)
    return Engine(loaded, tokenizer, name=name, max_context=max_context, prefill_chunk=prefill_chunk)


class Engine:
    def __init__(self, loaded, tokenizer, *, name=None, max_context=0, prefill_chunk=DEFAULT_PREFILL_CHUNK):
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.tokenizer = tokenizer
        self.name = name or _model_id(loaded.path)
        self.backend, self.backend_reason = loaded.backend, loaded.backend_reason
        cap = self.config.max_seq_len
        self.max_context = min(cap, max_context) if max_context else cap
        self.prefill_chunk = prefill_chunk
        self.template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token) \
            if tokenizer.chat_template else ChatTemplate.fallback(tokenizer.bos_token, tokenizer.eos_token)
        self._constraints = ConstraintCompiler(tokenizer, self.config.vocab_size)
        self._cache = None          # allocated on first use (on the compute thread)
        self._cached_ids = []       # tokens whose K/V are in self._cache, in order

    def encode(self, text, add_bos):
        return self.tokenizer.encode(text, add_bos=add_bos)

    def decode(self, ids, skip_special=True):
        return self.tokenizer.decode(ids, skip_special=skip_special)

    def render_chat(self, messages, tools=None, add_generation_prompt=True, **kwargs):
        return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **kwargs):
        # NOTE(bos): templates usually emit their own BOS; add one only where the model wants it and
        # the rendered text does not already start with it.
        text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.tokenizer.encode(text, add_bos=self.tokenizer.add_bos)

    def compile_grammar(self, grammar):
        """A compiled grammar (`.start()` -> Constraint for SamplingParams.constraint); ValueError
        naming the problem when the spec (llguidance JSON grammar format) cannot compile."""
        return self._constraints.compile(grammar)

    def generate(self, prompt_ids, params, should_stop=None):
        """Events for one run (see engine/__init__); one forward pass per `next()`."""
        prompt_ids = [int(t) for t in prompt_ids]
        self._check_prompt(prompt_ids)
        cache = self._ensure_cache()
        return self._run(Generation(self.model, cache, self.tokenizer, prompt_ids, params,
                                    should_stop=should_stop, prefill_chunk=self.prefill_chunk,
                                    max_context=self.max_context, cached_ids=self._cached_ids))

    def _run(self, generation):
        try:
            yield from generation
        except BaseException:
            self._drop_cache()      # a half-written chunk leaves the cache unknown
            raise

    def score(self, prompt_ids, top=0):
        """Log-probability of every prompt token given the ones before it (the first is None)."""
        prompt_ids = [int(t) for t in prompt_ids]
        self._check_prompt(prompt_ids)
        cache = self._ensure_cache()
        self._drop_cache()
        out = [(None, [])]
        for start in range(0, len(prompt_ids), self.prefill_chunk):
            piece = prompt_ids[start:start + self.prefill_chunk]
            lp = log_softmax(self.model.forward(piece, cache, logits="all"))      # [T, V]
            for row, nxt in zip(lp, prompt_ids[start + 1:start + len(piece) + 1]):
                out.append((float(row[nxt]), top_n(row, top)))
        self._cached_ids[:] = prompt_ids
        return out

    def _check_prompt(self, ids):
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) + 1 > self.max_context:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.max_context}")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")

    def _ensure_cache(self):
        if self._cache is None:
            self._cache = self.model.new_cache(self.max_context)
        return self._cache

    def _drop_cache(self):
        self._cached_ids.clear()
        if self._cache is not None:
            self._cache.reset()


def _model_id(path):
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name
