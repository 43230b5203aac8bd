"""The real Gemma 3 270M (Q4_K_M GGUF from `turbospark pull gemma3-270m`) against transformers loading
the same file (dequantized to float32, CPU): greedy tokens and logits along the way. Skipped when the
model is not pulled."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from turbospark_wsgi.engine import load_engine  # noqa: E402

_spec = importlib.util.spec_from_file_location("tiny_models_gemma3", Path(__file__).with_name("conftest.py"))
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

_spec = importlib.util.spec_from_file_location("batching_gemma3", Path(__file__).with_name("test_batching.py"))
batching = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(batching)

_spec = importlib.util.spec_from_file_location("parity_hf_gemma3", Path(__file__).with_name("test_parity_hf.py"))
parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity)
# parity is the float32 kernels' contract (the float32 reference); int8 activations have their own test
_float32_activations = parity._float32_activations

GEMMA3 = tiny.MODELS_DIR / "gemma-3-270m-q4_k_m.gguf"
STEPS = 32
TOL = 1e-3
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    if not GEMMA3.exists():
        pytest.skip(f"Gemma 3 270M not pulled ({GEMMA3}): turbospark pull gemma3-270m")
    return load_engine(GEMMA3, device="cpu", max_batch=2)


@pytest.fixture(scope="module")
def reference(engine):
    threads = torch.get_num_threads()
    model = tiny.hf_causal_lm(GEMMA3)
    torch.set_num_threads(1)
    yield model
    torch.set_num_threads(threads)


def ours_greedy(model, ids, steps):
    """(tokens, logits [steps, vocab] at each chosen step) from a prefill then single-token steps."""
    cache = model.new_cache()
    last, out, logits = model.forward(ids, cache), [], []
    for _ in range(steps):
        logits.append(last)
        out.append(int(np.argmax(last)))
        last = model.forward([out[-1]], cache)
    return out, np.stack(logits)


def hf_greedy(model, ids, steps):
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=10**9,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return gen.sequences[0, len(ids):].tolist(), torch.cat(gen.logits).numpy()


def assert_greedy_parity(engine, reference, ids, steps=STEPS, tol=TOL):
    ours, ours_logits = ours_greedy(engine.model, ids, steps)
    theirs, their_logits = hf_greedy(reference, ids, steps)
    delta = float(np.abs(ours_logits - their_logits).max())
    print(f"\n{len(ids)}-token prompt: {steps} greedy tokens, max |dlogit| {delta:.2e}")
    assert ours == theirs
    assert delta <= tol
    return ours


def test_the_file_is_gemma3_with_local_and_global_layers(engine):
    c = engine.config
    assert (c.arch, c.n_layer, c.sliding_window, c.max_seq_len) == ("gemma3", 18, 512, 32768)
    assert [i for i in range(c.n_layer) if i not in c.local_layers] == [5, 11, 17]


def test_raw_prompt_matches_transformers(engine, reference):
    ids = engine.encode("The capital of France is", add_bos=engine.add_bos)
    assert ids[0] == engine.tokenizer.bos_id
    out = assert_greedy_parity(engine, reference, ids)
    assert "France" in engine.decode(out)


def test_chat_prompt_matches_transformers(engine, reference):
    """The file ships no template: Gemma's own puts the system text into the first user turn."""
    ids = engine.apply_chat_template([{"role": "system", "content": "Answer in one word."},
                                      {"role": "user", "content": "What colour is the sky?"}])
    assert engine.decode(ids, skip_special=False) == ("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat colour "
                                                      "is the sky?<end_of_turn>\n<start_of_turn>model\n")
    assert_greedy_parity(engine, reference, ids)


def test_a_prompt_longer_than_the_window_matches_transformers(engine, reference):
    """600 prompt tokens: the local layers (window 512) no longer see the start, the global ones do.

    NOTE(tolerance): past a few hundred positions float32 itself moves these logits by ~1e-3 (the
    reference against transformers in float64 on this prompt: 1.1e-3 past position 512, 1.9e-3 at
    position 352, where its float32 rotary angles against exact ones alone move them by 0.02), hence 5e-3."""
    text = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(200))
    ids = engine.encode(text, add_bos=True)[:600]
    assert len(ids) == 600
    assert_greedy_parity(engine, reference, ids, steps=8, tol=5e-3)


def test_tokenizing_4k_tokens_is_faster_than_prefilling_128(engine):
    """Gemma's 262k-piece SentencePiece vocabulary: 4096 tokens of prose and markup encode in
    milliseconds (measured 1-5 ms, 2 cores), while the prefill of those tokens takes a minute; the
    bound here is a 128-token prefill."""
    import time
    repo = Path(__file__).resolve().parents[2]
    text = "".join(p.read_text() for p in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]) * 2
    ids = engine.encode(text, add_bos=True)[:4096]
    text = engine.decode(ids)
    start = time.perf_counter()
    ids = engine.encode(text, add_bos=True)
    encode_s = time.perf_counter() - start
    assert len(ids) >= 4000
    model = engine.model
    start = time.perf_counter()
    model.forward(ids[:128], model.new_cache(), logits="last")
    assert encode_s < time.perf_counter() - start


def test_batching_and_a_prefix_past_the_window_change_nothing(engine):
    """Two prompts decoded together equal each alone; a second turn over a 560-token first turn (past
    the 512 window) reuses it from the prefix cache and runs as a cold start does."""
    from turbospark_wsgi.engine import SamplingParams
    prompts = [engine.encode(t, add_bos=True) for t in ("The capital of France is", "Once upon a time, a fox")]
    params = [SamplingParams(temperature=0, max_new_tokens=8) for _ in prompts]
    solo = [batching.run_alone(engine, p, q) for p, q in zip(prompts, params)]
    assert batching.run_together(engine, prompts, params) == solo
    text = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(200))
    turn1 = engine.encode(text, add_bos=True)[:560]
    batching.check_next_turn_reuses_the_whole_prompt(engine, turn1, engine.encode(" Which box?", add_bos=False), 4)
