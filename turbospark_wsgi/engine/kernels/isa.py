"""Which integer-dot instructions the int8 kernels compile to on this CPU, and why.

The int8 kernels (int8.py) compute every weight block's dot product with the activations exactly
in int32, so each path below gives the same integers, and so the same logits, as the others; they
differ only in speed. Paths, best first:

- `vnni512`: AVX-512 VNNI `vpdpbusd` on 512-bit vectors (Zen 4, Ice Lake server and later Xeons).
- `avxvnni`: `vpdpbusd` on 256-bit vectors (AVX-VNNI: Alder Lake and later cores, Zen 5).
- `avx2`: `vpmaddubsw` + `vpmaddwd` on 256-bit vectors (Haswell and later, Zen 1-3: most x86 machines).
  8-bit weights take |w| and move the sign onto the activation (`vpsignb`), so no pair saturates.
- `neon`: aarch64 `sdot` (ARMv8.2 dotprod: Graviton 2+, Ampere, Apple M). Compiled and checked for
  its instructions here; not run on an x86 build machine.
- `generic`: plain LLVM vector code (widen to int32 and multiply); any CPU.

`choose` picks the best the compile target has. numba compiles for the host CPU unless NUMBA_CPU_NAME
names another (e.g. `znver3` to build and measure the AVX2 code on an AVX-512 machine); then the
named CPU's features count, and only those the host has too (code for a feature the host lacks would
stop the process with an illegal instruction).
"""
import platform
from dataclasses import dataclass

PATHS = ("vnni512", "avxvnni", "avx2", "neon", "generic")
IDS = {name: i for i, name in enumerate(PATHS)}
# What each path needs, as LLVM names CPU features.
NEEDS = {"vnni512": ("avx512vnni", "avx512bw", "avx512f"), "avxvnni": ("avxvnni", "avx2"),
         "avx2": ("avx2",), "neon": ("dotprod",), "generic": ()}
# The features of CPU names numba may be told to compile for (NUMBA_CPU_NAME), for the paths above.
_NAMED = {
    **dict.fromkeys(("haswell", "broadwell", "skylake", "znver1", "znver2", "znver3", "x86-64-v3"), ("avx2",)),
    **dict.fromkeys(("alderlake", "raptorlake", "meteorlake", "arrowlake", "gracemont"), ("avx2", "avxvnni")),
    **dict.fromkeys(("icelake-server", "icelake-client", "cascadelake", "cooperlake", "tigerlake", "rocketlake",
                     "znver4", "x86-64-v4"), ("avx2", "avx512f", "avx512bw", "avx512vnni")),
    **dict.fromkeys(("sapphirerapids", "emeraldrapids", "graniterapids", "znver5"),
                    ("avx2", "avx512f", "avx512bw", "avx512vnni", "avxvnni")),
}


@dataclass(frozen=True, slots=True)
class Choice:
    path: str        # one of PATHS
    reason: str      # why, in words for the startup log and `turbospark models`

    @property
    def id(self):
        return IDS[self.path]


def host_features():
    """LLVM's names of the host CPU's features that are present."""
    from llvmlite import binding
    return {name for name, on in binding.get_host_cpu_features().items() if on}


def target_features():
    """(features, cpu name) numba compiles for: the host's, or those of NUMBA_CPU_NAME's CPU that the
    host has too (an unknown name: none, i.e. the generic path)."""
    import numba
    host = host_features()
    name = numba.config.CPU_NAME
    if name in (None, "", "host"):
        return host, "host"
    return set(_NAMED.get(name, ())) & host, name


def runnable(features=None, machine=None):
    """The paths whose instructions `features` (default: the compile target's) include, best first."""
    machine = machine or platform.machine().lower()
    feats = target_features()[0] if features is None else set(features)
    arm = machine in ("aarch64", "arm64")
    out = []
    for path in PATHS:
        if path == "neon" and not arm or path in ("vnni512", "avxvnni", "avx2") and arm:
            continue
        if all(f in feats for f in NEEDS[path]) or path == "avxvnni" and {"avx512vnni", "avx512vl"} <= feats:
            out.append(path)          # (AVX-512 VNNI runs the 256-bit vpdpbusd too, EVEX-encoded)
    return out


def choose(want="auto", allow_vnni=True, features=None, machine=None):
    """The path for `want` ("auto" or one of PATHS): auto takes the best runnable one (without the
    VNNI paths when `allow_vnni` is off); a named path the target lacks falls back to auto's choice,
    saying so."""
    if want not in ("auto", *PATHS):
        raise ValueError(f"int8 instruction path must be auto or one of {', '.join(PATHS)}, not {want!r}")
    if features is None:
        feats, cpu = target_features()
    else:
        feats, cpu = set(features), "given"
    paths = runnable(feats, machine)
    if not allow_vnni:
        paths = [p for p in paths if p not in ("vnni512", "avxvnni")]
    if want != "auto":
        if want in paths:
            return Choice(want, f"{want} requested")
        best = paths[0]
        return Choice(best, f"{want} requested but the CPU ({cpu}) lacks {'/'.join(NEEDS[want])}: {best} instead")
    best = paths[0]
    missing = [p for p in PATHS[:PATHS.index(best)] if p in runnable(set().union(*NEEDS.values()), machine)]
    why = f"best for the CPU ({cpu})"
    if missing:
        lacks = sorted({f for p in missing for f in NEEDS[p] if f not in feats})
        why += f"; no {', '.join(lacks)}" if lacks else "; VNNI off by setting"
    return Choice(best, f"{best}: {why}")
