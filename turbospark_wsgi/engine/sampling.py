"""Sampling parameters, logits processors and samplers."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0            # 0 = argmax
    top_k: int = 0                      # 0 = off
    top_p: float = 1.0                  # 1 = off
    min_p: float = 0.0                  # 0 = off
    repetition_penalty: float = 1.0     # 1 = off (HF/llama.cpp style, over prompt + output)
    presence_penalty: float = 0.0       # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)   # token id -> bias added to the logit
    seed: int | None = None             # None: fresh entropy
    logprobs: int | None = None         # None: none; N >= 0: chosen token's logprob plus the top N
    stop: tuple = ()                    # stop strings, matched on text
    stop_token_ids: tuple = ()          # extra ids that end the run (besides the model's eos/end-of-turn)
    ignore_eos: bool = False
