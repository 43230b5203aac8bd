"""What the rest of the package may use of a loaded model: `TextEngine` (Engine, generation),
`EmbeddingEngine` (encoder.Encoder, /v1/embeddings) and `RerankEngine` (cross_encoder.CrossEncoder,
/v1/rerank and /v1/score). A stand-in for any of them implements every member."""
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable


class EngineTokenizer(Protocol):
    """The tokenizer's vocabulary as the service reads it (tokenizer.Tokenizer)."""

    @property
    def bos_token(self) -> str | None: ...

    @property
    def eos_token(self) -> str | None: ...

    def token_text(self, token_id: int) -> tuple[str, bytes, int]:
        """(text, bytes, width) of one token as logprobs show it (special tokens by name, width 0)."""


class ModelConfig(Protocol):
    vocab_size: int
    max_seq_len: int


class ChatTemplateSource(Protocol):
    source: str             # the Jinja source, read by the chat output parsers


@runtime_checkable
class TextEngine(Protocol):
    """A generation model. Each `next()` on `generate` or `score` runs at most one step, on the
    caller's (compute) thread; `should_stop` is polled before each step and cancels the run;
    `client` says whose run it is (the batch's rows are shared fairly between clients)."""

    kind: str               # "generation"
    capabilities: tuple     # the routes it serves: ("generation",), or ("generation", "embedding")
    name: str
    backend: str            # "numpy" | "cupy"
    backend_reason: str
    max_context: int        # prompt + reply tokens
    config: ModelConfig
    tokenizer: EngineTokenizer
    template: ChatTemplateSource

    @property
    def add_bos(self) -> bool:
        """Whether the model puts BOS before a raw text prompt."""

    def encode(self, text: str, add_bos: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    def render_chat(self, messages, tools=None, add_generation_prompt=True, template_kwargs=None) -> str: ...

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True,
                            template_kwargs=None) -> list[int]: ...

    def compile_grammar(self, grammar) -> Any:
        """A compiled grammar (`.start()` -> a run's `constraint`); ValueError when it cannot compile."""

    def thinking_budget(self, budget: int, prompt_ids: Sequence[int], open_tag: str = "<think>",
                        close_tag: str = "</think>", then: Any = None) -> Any:
        """A run's `constraint` closing the think tag after `budget` reasoning tokens (None:
        nothing forced, the reasoning tokens only counted, in `.thought`)."""

    def generate(self, prompt_ids: Sequence[int], params, should_stop=None, client: str = "",
                 cache_salt: str = "", background: bool = False, adapter: Any = None, constraint: Any = None,
                 choice: int = 0) -> Iterator:
        """Prefill progress, Tokens (Paused while it waits for a row of the batch), then one Finish
        (engine.events). Only runs with the same `cache_salt` share cached prompt prefixes; a
        `background` run takes only the rows and steps the others leave; `adapter`: a LoRA adapter
        of this model for this run (None: the base). `params` are the request's; `constraint` (or
        None) and `choice` (its index among the request's runs: a seeded run draws from seed +
        choice) are this run's own."""

    def score(self, prompt_ids: Sequence[int], top: int = 0, should_stop=None, client: str = "",
              cache_salt: str = "", background: bool = False, adapter: Any = None) -> Iterator:
        """Prefill progress and Scores for every prompt token (the first None), then one Finish."""


@runtime_checkable
class EmbeddingEngine(Protocol):
    """A sentence-embedding model: token ids in, one vector per input out."""

    kind: str               # "embedding", or "generation" for a generation model that embeds too
    capabilities: tuple     # ("embedding",), or ("generation", "embedding")
    name: str
    backend: str
    backend_reason: str
    max_context: int        # the longest input, in tokens
    max_tokens: int
    vocab_size: int
    dim: int
    matryoshka: bool        # trained so that leading dimensions alone embed (OpenAI's `dimensions`)
    special_span: tuple     # (leading, trailing) special tokens encode_batch puts around a text
    embed_chunk_tokens: int  # tokens of inputs one compute-thread call to `embed` should take

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def embed(self, sequences: Sequence[Sequence[int]], dimensions: int | None = None) -> Any:
        """float32 [len(seqs), dimensions or dim]."""


@runtime_checkable
class RerankEngine(Protocol):
    """A cross-encoder: (first, second) text pairs in, one relevance score per pair out."""

    kind: str               # "rerank"
    capabilities: tuple     # ("rerank",)
    name: str
    backend: str
    backend_reason: str
    max_context: int        # the longest pair, in tokens
    max_tokens: int
    score_chunk_tokens: int  # tokens of pairs one compute-thread call to `score` should take

    def encode_pairs(self, pairs: Sequence[tuple[str, str]]) -> tuple[list, list]:
        """([(ids, segment ids or None)], [cut]): each second text's tail cut to fit max_tokens;
        engine.QueryTooLong when a first text leaves no room."""

    def score(self, pairs: Sequence[tuple]) -> Any:
        """float32 [len(pairs)] relevance scores of encode_pairs' pairs."""
