from dataclasses import dataclass, field

# The largest count a model file may give a size: a layer count, a width, a vocabulary. Far past any
# model there is (126 layers, widths of 2**15, vocabularies of 2**18), and small enough that lists
# built per layer or per head before the tensors are checked cannot take the process's memory.
MAX_LAYERS = 4096
MAX_COUNT = 1 << 31

# ModelConfig.arch -> what sets the family apart from llama, as ModelConfig fields. The forward pass
# is one; an architecture is these switches plus the tensors its weight table adds.
ARCH_FEATURES = {
    "llama": {},
    "qwen2": {"attn_bias": True},     # q/k/v projections carry biases
    "qwen3": {"qk_norm": True},       # per-head RMSNorm of q and k before the rotation
    "phi3": {"fused_qkv": True, "fused_gate_up": True},   # one q|k|v and one gate|up matrix in the file
    # Gemma 3: q/k norms, norms after attention and after the MLP too, norm weights stored as w - 1
    # by Hugging Face, GELU(tanh) gating, embeddings scaled by sqrt(dim)
    "gemma3": {"qk_norm": True, "post_norms": True, "norm_plus_one": True, "gelu_gate": True,
               "embed_scale": True},
}


@dataclass(slots=True)
class ModelConfig:
    arch: str                      # a key of ARCH_FEATURES: "llama" (llama, mistral), "qwen2", "qwen3", "phi3", "gemma3"
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
    attn_bias: bool = False        # q/k/v biases (Qwen2)
    qk_norm: bool = False          # RMSNorm over each q and k head, weights [head_dim] (Qwen3)
    fused_qkv: bool = False        # the file holds q|k|v as one matrix (Phi-3)
    fused_gate_up: bool = False    # the file holds gate|up as one matrix (Phi-3)
    post_norms: bool = False       # RMSNorm of the attention and MLP outputs before each residual add
    norm_plus_one: bool = False    # Hugging Face norm weights hold w - 1 (GGUF files hold w)
    gelu_gate: bool = False        # gelu_tanh(gate) * up instead of silu(gate) * up
    embed_scale: bool = False      # token embeddings times sqrt(dim)
    query_scalar: float = 0.0      # attention scale 1/sqrt(query_scalar); 0: head_dim
    final_softcap: float = 0.0     # logits -> cap * tanh(logits / cap); 0: none
    sliding_window: int = 0        # keys a local layer's query reads: positions p-window+1..p; 0: none
    rope_local_theta: float = 0.0  # rotary base of the local (sliding-window) layers; 0: as global
    local_layers: tuple = ()       # indices of the sliding-window layers (Gemma 3: their rotary base differs)

    def __post_init__(self):
        if self.arch not in ARCH_FEATURES:
            raise ValueError(f"unsupported model architecture {self.arch!r}")
        for k, v in ARCH_FEATURES[self.arch].items():
            setattr(self, k, v)
        if not self.head_dim:
            self.head_dim = self.dim // self.n_head
        if not self.rope_dim:
            self.rope_dim = self.head_dim

    def layer_window(self, i):
        """The sliding window of layer i (0: the layer attends to every earlier position)."""
        return self.sliding_window if i in self.local_layers else 0

    @property
    def kv_mul(self):              # query heads per KV head
        return self.n_head // self.n_kv_head
