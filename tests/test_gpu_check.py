"""tools/gpu_check.py --device cpu: the device check's dry run, the same code to the end on small
sizes with the kernels built for the host, and its pieces that need no device at all."""
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"
pytestmark = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="needs a C++ compiler")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_runs_every_step_and_writes_its_report(gpu_check, tmp_path, capsys):
    assert gpu_check.main([str(tmp_path), "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = report["steps"]
    assert report["finished"] and not [s for s, v in steps.items() if isinstance(v, dict) and
                                       ("error" in v or "skipped" in v)]
    parity = steps["parity_0"]
    assert parity["max_abs_dlogit"] < 1e-3 < parity["max_abs_logit"]     # logits of some size, matched
    assert parity["greedy_agree"] == "8/8" and parity["batched_vs_solo_max_abs"] < 1e-5
    speed = steps["speed"]
    for key in ("prefill_16_tok_s", "prefill_64_tok_s", "decode_1_tok_s", "batch_4_aggregate_tok_s",
                "bytes_per_token_b1"):
        assert speed[key] > 0
    assert 0 < steps["roofline"]["fraction_of_bound_b1"]
    assert [v["gb_s_b1"] > 0 and v["gb_s_b8"] > 0 for v in speed["launch_shapes"]] == [True]
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"] {step}: " in log for step in steps)
    assert capsys.readouterr().out.strip() == log.strip()                 # printed as written


def test_steps_past_the_budget_are_skipped_and_say_so(gpu_check, tmp_path):
    assert gpu_check.main([str(tmp_path), "--device", "cpu", "--budget-s", "0"]) == 1
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert steps["device"] == {"skipped": "time budget of 0.0 s spent"}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_random_blocks_have_the_asked_spread(gpu_check, qtype):
    from gguf import GGMLQuantizationType, quants
    raw = gpu_check.random_blocks(np.random.default_rng(0), qtype, 64, 512, std=0.05)
    w = quants.dequantize(raw, GGMLQuantizationType[qtype])
    assert abs(w.mean()) < 0.01 and 0.035 < w.std() < 0.07
