"""Choosing the int8 kernels' instruction path (isa.py) from the CPU's features, and each model
keeping its own kernel settings."""
import pytest

from turbospark_wsgi.engine.kernels import isa
from turbospark_wsgi.engine.options import EngineOptions, kernel_plan

ZEN4 = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512vnni"}
ZEN3 = {"avx2", "fma"}
ALDERLAKE = {"avx2", "avxvnni"}


@pytest.mark.parametrize("features, machine, best", [
    (ZEN4, "x86_64", "vnni512"), (ALDERLAKE, "x86_64", "avxvnni"), (ZEN3, "x86_64", "avx2"),
    (set(), "x86_64", "generic"), ({"dotprod"}, "aarch64", "neon"), (set(), "aarch64", "generic"),
    ({"avx2", "dotprod"}, "arm64", "neon")])
def test_auto_takes_the_best_path_the_features_have(features, machine, best):
    assert isa.choose(features=features, machine=machine).path == best


def test_a_missing_feature_falls_back_and_says_why():
    got = isa.choose("vnni512", features=ZEN3, machine="x86_64")
    assert got.path == "avx2" and "lacks avx512vnni/avx512bw/avx512f" in got.reason
    got = isa.choose("avx2", features=set(), machine="x86_64")
    assert got.path == "generic" and "lacks avx2" in got.reason
    auto = isa.choose(features=ZEN3, machine="x86_64")
    assert "no " in auto.reason and "avx512vnni" in auto.reason


def test_vnni_off_skips_both_vnni_paths():
    assert isa.choose(allow_vnni=False, features=ZEN4 | {"avxvnni"}, machine="x86_64").path == "avx2"


def test_no_arm_path_on_x86_and_no_x86_path_on_arm():
    assert "neon" not in isa.runnable({"dotprod", "avx2"}, "x86_64")
    assert isa.runnable(ZEN4, "aarch64") == ["generic"]


def test_a_named_cpu_counts_only_its_features_the_host_has(monkeypatch):
    import numba
    monkeypatch.setattr(isa, "host_features", lambda: set(ZEN4))
    monkeypatch.setattr(numba.config, "CPU_NAME", "znver3", raising=False)
    assert isa.target_features() == ({"avx2"}, "znver3")
    monkeypatch.setattr(numba.config, "CPU_NAME", "sapphirerapids", raising=False)
    assert "avxvnni" not in isa.target_features()[0]            # the host (Zen 4) has none
    monkeypatch.setattr(numba.config, "CPU_NAME", "some-future-cpu", raising=False)
    assert isa.target_features()[0] == set()


def test_unknown_paths_are_refused():
    with pytest.raises(ValueError, match="int8_isa must be one of"):
        EngineOptions(int8_isa="sse9")
    with pytest.raises(ValueError, match="instruction path must be auto or one of"):
        isa.choose("sse9")


def test_auto_activations_take_the_float_kernels_without_integer_dots(monkeypatch):
    from turbospark_wsgi.engine.kernels import int8 as kernels_q8
    if not kernels_q8.AVAILABLE:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(kernels_q8, "choose", lambda want="auto", allow_vnni=True: isa.Choice("generic", "test"))
    plan = kernel_plan(EngineOptions())
    assert plan.activations == "float32" and "no integer-dot instructions" in plan.reason
    assert kernel_plan(EngineOptions(activations="int8")).activations == "int8"     # asked for: kept
    monkeypatch.setattr(kernels_q8, "choose", lambda want="auto", allow_vnni=True: isa.Choice("avx2", "avx2: best"))
    plan = kernel_plan(EngineOptions())
    assert (plan.activations, plan.isa, plan.fused) == ("int8", "avx2", True)
    assert "int8 activations, integer dots: avx2, fused layers" in plan.describe()


def test_two_models_in_one_process_keep_their_own_kernel_settings(tiny_gguf):
    from turbospark_wsgi.engine.kernels import cpu as kernels_cpu
    from turbospark_wsgi.engine.loader import load_model
    if not kernels_cpu.AVAILABLE:
        pytest.skip("numba is not installed")
    path = tiny_gguf(qtype="Q8_0").path
    a = load_model(path, device="cpu", activations="int8", fused_layers=False, int8_isa="generic").model
    b = load_model(path, device="cpu", activations="float32").model
    c = load_model(path, device="cpu").model                         # unset: the defaults, not b's
    assert (a.plan.activations, a.plan.fused, a.plan.isa) == ("int8", False, "generic") and not a.fused
    assert b.plan.activations == "float32" and not b.fused
    assert c.plan == kernel_plan(EngineOptions()) and c.plan.fused
    assert a.w.layers[0].wo.activations == "int8" and b.w.layers[0].wo.activations == "float32"


def _lowered(path, triple, cpu, features, signed):
    """The assembly of one unit's dots on `path` (int8_dot._unit_dots), compiled for `triple`."""
    from llvmlite import binding, ir
    from turbospark_wsgi.engine.kernels import int8_dot
    i32x16 = ir.VectorType(ir.IntType(32), 16)
    mod = ir.Module(name="unit")
    mod.triple = triple
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i32x16.as_pointer(), i32x16.as_pointer(),
                                                          ir.IntType(32).as_pointer()]), "unit")
    b = ir.IRBuilder(fn.append_basic_block())
    acc, w, a = fn.args
    total = int8_dot._unit_dots(b, isa.IDS[path], b.load(acc), [(b.load(w), b.load(a))], signed)
    b.store(total, acc)
    b.ret_void()
    binding.initialize_all_targets()
    binding.initialize_all_asmprinters()
    tm = binding.Target.from_triple(triple).create_target_machine(cpu=cpu, features=features, opt=2)
    return tm.emit_assembly(binding.parse_assembly(str(mod)))


@pytest.mark.parametrize("signed", [False, True])
def test_the_neon_path_compiles_to_sdot_for_aarch64(signed):
    """The aarch64 path cannot run on an x86 build machine: this checks it lowers to `sdot`."""
    from turbospark_wsgi.engine.kernels import int8 as kernels_q8
    if not kernels_q8.AVAILABLE:
        pytest.skip("numba is not installed")
    asm = _lowered("neon", "aarch64-unknown-linux-gnu", "neoverse-n1", "+neon,+dotprod", signed)
    assert asm.count("sdot") == 4                      # 16 rows = 4 x (4 lanes x 4 bytes)


@pytest.mark.parametrize("path, instruction", [("avx2", "vpmaddubsw"), ("avxvnni", "vpdpbusd"),
                                               ("vnni512", "vpdpbusd")])
def test_the_x86_paths_compile_to_their_instructions(path, instruction):
    from turbospark_wsgi.engine.kernels import int8 as kernels_q8
    if not kernels_q8.AVAILABLE:
        pytest.skip("numba is not installed")
    cpu, feats = {"avx2": ("znver3", ""), "avxvnni": ("alderlake", ""), "vnni512": ("znver4", "")}[path]
    asm = _lowered(path, "x86_64-unknown-linux-gnu", cpu, feats, True)
    assert instruction in asm
    if path == "avxvnni":
        assert "{vex}" in asm or "zmm" not in asm       # VEX-encoded: no AVX-512 needed
