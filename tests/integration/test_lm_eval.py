"""lm-evaluation-harness through `local-completions` against real gunicorn equals lm-eval's own `hf`
backend on the same weights: per-item loglikelihoods within 1e-3 and the same accuracy, whether it
sends token ids one request at a time, or text prompts (`tokenized_requests=False`, tokenized by the
server's own /tokenizer_info + /tokenize: `tokenizer_backend=remote`) four to a request
(`batch_size=4`: one prompt list); text and token-id requests score alike.

The model is a tiny random Llama in Hugging Face format written by the test; we serve it from the
same files transformers loads. Skips only where lm-eval cannot be imported.
"""
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow
if importlib.util.find_spec("lm_eval") is None:
    pytest.skip("lm-eval is not installed", allow_module_level=True)

_spec = importlib.util.spec_from_file_location("tiny_models", Path(__file__).parents[1] / "engine" / "conftest.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

WORDS = ["cat", "dog", "mat", "hat", "the", "sat", "ran", "in", "on", "red", "big", "sun", "tea", "pot"]
TASK = "turbospark_tiny_mc"


def write_task(root, n_items=20, seed=0):
    rng = np.random.default_rng(seed)
    with (root / "items.jsonl").open("w") as f:
        for _ in range(n_items):
            question = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 7))))
            choices = [" " + " ".join(rng.choice(WORDS, size=int(rng.integers(1, 3)))) for _ in range(4)]
            f.write(json.dumps({"question": question.capitalize() + ":", "choices": choices,
                                "answer": int(rng.integers(0, 4))}) + "\n")
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'items.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: choices\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")


def evaluate(tmp, model, model_args, batch_size=1):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["HF_DATASETS_CACHE"] = str(tmp / "datasets")
    import lm_eval
    from lm_eval.tasks import TaskManager
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=batch_size,
                                  task_manager=TaskManager(include_path=str(tmp / "task")), log_samples=True,
                                  limit=None, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    lls = [[r[0][0] for r in s["resps"]] for s in samples]
    return np.array(lls, dtype=np.float64), out["results"][TASK]["acc,none"]


def test_local_completions_matches_the_hf_backend(tmp_path, start_gunicorn):
    models = tmp_path / "models"
    cfg = tiny.hf_config(max_position_embeddings=256)
    tiny.write_hf_dir(models / "tiny", cfg, tiny.random_state(cfg, 1))
    (tmp_path / "task").mkdir()
    write_task(tmp_path / "task")
    server = start_gunicorn("gthread", models=str(models), model="tiny", max_batch=4)
    local = {"base_url": f"{server.url}/v1/completions", "model": "tiny", "num_concurrent": 1, "max_retries": 1}
    ours, our_acc = evaluate(tmp_path, "local-completions", dict(
        local, tokenizer=str(models / "tiny"), tokenizer_backend="huggingface", tokenized_requests=True))
    # NOTE(bos): text prompts get BOS only by the model's own rule (this tokenizer says
    # add_bos_token false), so they score as the token ids lm-eval counted its context in.
    text, text_acc = evaluate(tmp_path, "local-completions", dict(
        local, tokenizer_backend="remote", tokenized_requests=False), batch_size=4)
    ref, ref_acc = evaluate(tmp_path, "hf", {"pretrained": str(models / "tiny"), "dtype": "float32",
                                             "device": "cpu"})
    assert ours.shape == text.shape == ref.shape == (20, 4)
    np.testing.assert_allclose(text, ours, atol=1e-6, rtol=0)
    np.testing.assert_allclose(ours, ref, atol=1e-3, rtol=0)
    assert our_acc == text_acc == ref_acc
    print(f"lm-eval: 20 items x 4 choices, max |dLL| = {np.abs(ours - ref).max():.2e} (ids), "
          f"{np.abs(text - ref).max():.2e} (text, batch 4), acc {our_acc} == {text_acc} == {ref_acc}")

