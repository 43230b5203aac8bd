from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelConfig:
    arch: str                      # "llama" (llama family), later "qwen2", "qwen3", "gemma3"
    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    head_dim: int = 0              # 0: dim // n_head
    rope_dim: int = 0              # 0: head_dim
    rope_scaling: dict = field(default_factory=dict)   # {"type": "linear"|"llama3"|..., "factor": ...}
    tied_embeddings: bool = False
    name: str = ""

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.dim // self.n_head
        if not self.rope_dim:
            self.rope_dim = self.head_dim

    @property
    def kv_mul(self):              # query heads per KV head
        return self.n_head // self.n_kv_head
