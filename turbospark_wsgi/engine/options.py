"""How to load and run a model: one frozen object, built by the server's Config (TURBOSPARK_*) or by
hand. Nothing in engine/ reads or writes the environment. `kernel_plan` turns a model's options into
the kernels it runs (kept on that model: two models in one process may differ); `apply` puts the
few process-wide kernel thresholds in force and is called by load_model, never at import."""
import dataclasses
from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")
WEIGHTS = ("auto", "quant", "fp32")
ACTIVATIONS = ("auto", "int8", "float32")
INT8_PATHS = ("auto", "vnni512", "avxvnni", "avx2", "neon", "generic")   # isa.PATHS
SPECULATIVE = ("auto", "on", "off")
KV_CACHE = ("auto", "f16", "f32", "q8_0")
KERNELS = ("auto", "native", "numba")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    device: str = "auto"            # auto: CuPy when a GPU works, else numpy; cpu; cuda
    # auto / quant: GGUF matrices stay in block form on the CPU (numba kernels); fp32: dequantized
    weights: str = "auto"
    max_context: int = 0            # tokens; 0 = the model's own context length
    prefill_chunk: int = 128        # prompt tokens per prefill step
    max_batch: int = 8              # sequences decoded together (and KV slots kept)
    max_paused: int = 0             # KV slots beyond the batch for sequences waiting paused
    # PERF(prefill): the measurements behind these two are in kernels/cpu.py (GEMV_MAX_B, SINGLE_ROW_THREADS)
    gemv_max_b: int = 256           # rows up to which quantized products run the fused kernels, not BLAS
    single_row_threads: int = 0     # cap on the numba threads of a one-row product; 0 = none
    # int8: activations quantized per block of 32, integer dot products; float32: the float kernels;
    # auto (or None): int8 where the CPU has integer-dot instructions (isa.py), else float32
    activations: str | None = "auto"
    encoder_threads: int = 1        # BLAS threads of an embedding encoder's products (encoder.py)
    int8_vnni: bool = True          # VNNI integer dots where the CPU has them (off: auto skips them)
    int8_isa: str = "auto"          # the int8 dots' instructions: auto (best the CPU has) or an isa.PATHS name
    fused_layers: bool = True       # int8 on the CPU: each layer one kernel call (kernels/layer.py); off: step by step
    # the KV cache's numbers: f16 (half floats), f32, q8_0 (GGUF's 8-bit blocks of 32: kv_cache.py,
    # NOTE(kv-q8)); auto: f16. f16 and q8_0 where layers are fused (the kernels read them there:
    # kernels/attention.py, NOTE(kv-half)), else f32; q8_0 where a head's values are a multiple of 32, else f16
    kv_cache: str = "auto"
    # the CPU kernels' code: native (C, built by the machine's compiler in about a second: kernels/native.py),
    # numba (compiled at a machine's first load, ~20 s); auto: native where it builds, else numba
    kernels: str = "auto"
    # speculative decoding (speculative.py): auto, where proposals pay; on: whenever there are some; off
    speculative: str = "auto"
    speculative_tokens: int = 8     # tokens proposed per sequence and step, at most
    draft_model: str = ""           # a model of the same tokenizer proposes instead of prompt lookup (path)
    # a directory where the CPU kernels' layout of a GGUF's matrices is written once and mapped by every
    # process that loads the file (engine/packed.py); "" = each process builds and holds its own
    weight_cache: str = ""

    def __post_init__(self):       # the device is checked where it is chosen (backend.select_backend)
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be auto, quant or fp32, not {self.weights!r}")
        if self.activations not in (None, *ACTIVATIONS):
            raise ValueError(f"activations must be auto, int8 or float32, not {self.activations!r}")
        if self.int8_isa not in INT8_PATHS:
            raise ValueError(f"int8_isa must be one of {', '.join(INT8_PATHS)}, not {self.int8_isa!r}")
        if self.kv_cache not in KV_CACHE:
            raise ValueError(f"kv_cache must be auto, f16, f32 or q8_0, not {self.kv_cache!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be auto, native or numba, not {self.kernels!r}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be auto, on or off, not {self.speculative!r}")
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, not {self.speculative_tokens!r}")
        if self.encoder_threads < 1:
            raise ValueError(f"encoder_threads must be >= 1, not {self.encoder_threads!r}")


def resolve(options, overrides):
    """`options` (default EngineOptions()) with the keyword `overrides` that are not None."""
    return dataclasses.replace(options or EngineOptions(), **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """The CPU kernels one model runs: `activations` "int8" or "float32", `isa` the int8 dots'
    instruction path (isa.PATHS), `fused` each layer one kernel call (int8 only), and why;
    `kv`: the KV cache's numbers where layers are fused, "f16", "f32" or "q8_0" (f32 elsewhere); `native`: the
    C kernels' Library (kernels/native.py) that runs them, or None for numba's, and `code` why."""

    activations: str
    isa: str
    fused: bool
    reason: str
    kv: str = "f16"
    native: object = None
    code: str = "numba kernels"
    kv_why: str = ""        # why the KV cache is not what the options asked for, or ""

    def for_heads(self, head_dim):
        """This plan for a model of `head_dim` values a head: q8_0 rows hold blocks of 32 values, so
        other heads keep f16, saying why."""
        if self.kv != "q8_0" or head_dim % 32 == 0:
            return self
        return dataclasses.replace(self, kv="f16", kv_why=f"q8_0 takes heads of a multiple of 32 values, not {head_dim}")

    def kv_dtype(self, head_dim):
        """The numpy dtype of a fused model's KV cache rows (the fused kernels read them:
        kernels/attention.py, NOTE(kv-half); kv_cache.py, NOTE(kv-q8)): "float16", "float32", or "int8"
        for q8_0 rows where the heads take them (for_heads)."""
        return {"f32": "float32", "q8_0": "int8"}.get(self.for_heads(head_dim).kv, "float16")

    def describe(self):
        """One line for the startup log and `turbospark models`."""
        fused = self.fused and self.activations == "int8"
        layers = "fused layers" if fused else "step by step"
        dots = f", integer dots: {self.isa}" if self.activations == "int8" else ""
        kv = self.kv if fused else "f32"
        why = f" ({self.kv_why})" if self.kv_why and fused else ""
        return f"{self.activations} activations{dots}, {layers}, {kv} KV cache{why}, {self.code} ({self.reason})"


def kernel_plan(options):
    """The KernelPlan for EngineOptions `options` on this CPU.

    PERF(isa): auto activations take int8 only where the CPU has integer-dot instructions. With
    plain vector code (the generic path) the int8 kernels lost to the float ones: SmolLM2-135M on a
    Zen 3 (AVX2 dots not yet used) prefilled 53 tok/s and decoded 34 with int8, 152 and 39 with
    float32; with vpmaddubsw (the avx2 path) int8 wins (README, tools/bench.py)."""
    from .kernels import int8 as kernels_q8
    choice = kernels_q8.choose(options.int8_isa, options.int8_vnni)
    act = options.activations or "auto"
    if act == "auto":
        if kernels_q8.AVAILABLE and choice.path != "generic":
            act, why = "int8", choice.reason
        else:
            act, why = "float32", "auto: no integer-dot instructions, the float kernels are faster"
    else:
        why = f"{act} requested" + (f"; {choice.reason}" if act == "int8" else "")
    if act == "int8" and not kernels_q8.AVAILABLE:
        act, why = "float32", "int8 requested but numba is absent"
    lib, code = native_kernels(options.kernels, choice.path, kernels_q8.AVAILABLE)
    return KernelPlan(act, choice.path, bool(options.fused_layers), why, "f16" if options.kv_cache == "auto" else options.kv_cache, lib, code)


def native_kernels(want, path, numba_present=True):
    """(Library or None, words) for TURBOSPARK_KERNELS `want` on instruction path `path`: the C
    kernels where asked for (auto or native) and they build here, else numba's, saying why."""
    if want == "numba" or not numba_present:
        return None, "numba kernels" + (" (requested)" if want == "numba" else "")
    from .kernels import native
    try:
        return native.load(path), "C kernels"
    except native.NativeUnavailable as e:
        return None, f"numba kernels: {e}"


def apply(options):
    """Puts the options' process-wide settings in force: the CPU kernels' thresholds. Called by
    load_model before any kernel runs."""
    from .kernels import cpu as kernels_cpu
    kernels_cpu.configure(gemv_max_b=options.gemv_max_b, single_row_threads=options.single_row_threads)
