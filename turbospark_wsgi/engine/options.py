"""How to load and run a model: one frozen object, built by the server's Config (TURBOSPARK_*) or by
hand. Nothing in engine/ reads the environment; `apply` puts the process-wide settings in force and
is called by load_model, never at import."""
import dataclasses
from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")
WEIGHTS = ("auto", "quant", "fp32")
ACTIVATIONS = ("int8", "float32")
SPECULATIVE = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    device: str = "auto"            # auto: CuPy when a GPU works, else numpy; cpu; cuda
    # auto / quant: GGUF matrices stay in block form on the CPU (numba kernels); fp32: dequantized
    weights: str = "auto"
    max_context: int = 0            # tokens; 0 = the model's own context length
    prefill_chunk: int = 128        # prompt tokens per prefill step
    max_batch: int = 8              # sequences decoded together (and KV slots kept)
    max_paused: int = 0             # KV slots beyond the batch for sequences waiting paused
    # PERF(prefill): the measurements behind these two are in kernels_cpu (GEMV_MAX_B, SINGLE_ROW_THREADS)
    gemv_max_b: int = 256           # rows up to which quantized products run the fused kernels, not BLAS
    single_row_threads: int = 0     # cap on the numba threads of a one-row product; 0 = none
    # int8: activations quantized per block of 32, integer dot products; float32: the float kernels;
    # None: as the process has them (kernels_cpu.ACTIVATIONS, int8 unless set)
    activations: str | None = None
    encoder_threads: int = 1        # BLAS threads of an embedding encoder's products (encoder.py)
    int8_vnni: bool = True          # AVX-512 VNNI integer dots where the CPU has them (kernels_q8)
    fused_layers: bool = True       # int8 on the CPU: each layer one kernel call (kernels_layer); off: step by step
    # speculative decoding (speculative.py): auto, where proposals pay; on: whenever there are some; off
    speculative: str = "auto"
    speculative_tokens: int = 8     # tokens proposed per sequence and step, at most
    draft_model: str = ""           # a model of the same tokenizer proposes instead of prompt lookup (path)

    def __post_init__(self):       # the device is checked where it is chosen (backend.select_backend)
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be auto, quant or fp32, not {self.weights!r}")
        if self.activations not in (None, *ACTIVATIONS):
            raise ValueError(f"activations must be int8 or float32, not {self.activations!r}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be auto, on or off, not {self.speculative!r}")
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, not {self.speculative_tokens!r}")
        if self.encoder_threads < 1:
            raise ValueError(f"encoder_threads must be >= 1, not {self.encoder_threads!r}")


def resolve(options, overrides):
    """`options` (default EngineOptions()) with the keyword `overrides` that are not None."""
    return dataclasses.replace(options or EngineOptions(), **{k: v for k, v in overrides.items() if v is not None})


def apply(options):
    """Puts the options' process-wide settings in force: the CPU kernels' thresholds and how their
    threads wait. Called by load_model before any kernel runs."""
    from . import kernels_cpu, kernels_layer, kernels_q8
    kernels_q8.use_vnni(options.int8_vnni)
    kernels_layer.configure(options.fused_layers)
    kernels_cpu.configure(gemv_max_b=options.gemv_max_b, single_row_threads=options.single_row_threads,
                          activations=options.activations or kernels_cpu.ACTIVATIONS)
