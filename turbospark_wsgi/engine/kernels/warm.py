"""The CPU kernels compiled before the first request: in two processes at once, and once per machine.

numba compiles a kernel on its first call and keeps the machine code in its on-disk cache (the
package's `__pycache__`, or NUMBA_CACHE_DIR), keyed by the CPU it was compiled for. `compiling`
wraps a model load's compile step:
- an exclusive file lock beside the cache, so that N gunicorn workers starting together compile
  once: the first compiles, the others wait and then load from the cache;
- cached kernels compiled from other kernel sources are dropped first (`purge_stale`);
- with a cold cache (no marker of an earlier complete warm-up for this CPU, path and kernel source),
  the float kernels compile in a child process on the other core while this one compiles the int8
  products and the layer kernel, the larger half.
`python -m turbospark_wsgi.engine.kernels.warm [GROUP] [ISA]` is that child's entry, and compiles every
group when run by hand (a container image can run it at build time: `turbospark warm`).

PERF(cold-start): see docs/performance.md's cold-start figures (launch to /health 200 with an empty cache,
a warm one, and N workers).
"""
import contextlib
import hashlib
import os
import sys
import tempfile

from . import children

_KERNELS = ("attention.py", "cpu.py", "int8.py", "int8_dot.py", "layer.py", "isa.py", "../quant.py")
_MODULES = ("attention", "cpu", "int8", "int8_dot", "layer")       # the modules numba caches kernels of


def cache_dir():
    """Where numba keeps this package's compiled kernels (and where the lock and marker live)."""
    import numba
    if numba.config.CACHE_DIR:
        return numba.config.CACHE_DIR
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
    try:
        os.makedirs(here, exist_ok=True)
        if os.access(here, os.W_OK):
            return here
    except OSError:
        pass
    return tempfile.gettempdir()


def _source_key():
    """What the compiled kernels depend on: numba, the CPU compiled for, and every kernel source."""
    import numba
    from llvmlite import binding
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256(f"{numba.__version__}|{numba.config.CPU_NAME}|{binding.get_host_cpu_name()}".encode())
    for name in _KERNELS:
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _marker(path):
    """The file saying that path `path`'s kernels were all compiled for this CPU and this source."""
    return os.path.join(cache_dir(), f"turbospark-warm-{_source_key()}-{path}")


def is_warm(path):
    return os.path.exists(_marker(path))


def purge_stale():
    """Removes the cached kernels compiled from other sources than these (and their markers).

    NOTE(stale-cache): numba checks only the file of the function it loads: the layer kernel
    (layer.py) cached before int8.py changed would keep the old products compiled inside it. So
    any change to any kernel source (an upgrade, a checkout) drops every cached kernel of them."""
    key, top = _source_key(), cache_dir()
    names = os.listdir(top) if os.path.isdir(top) else []
    if any(n.startswith(f"turbospark-warm-{key}-") for n in names):
        return
    for root, _, files in os.walk(top):
        ours = os.path.basename(root) == "__pycache__" or os.path.basename(root).startswith("kernels_")
        for f in files:
            if f.startswith("turbospark-warm-") or ours and f.endswith((".nbi", ".nbc")) \
                    and f.split(".")[0] in _MODULES:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(root, f))


@contextlib.contextmanager
def compiling(path):
    """Around a load's compile step on instruction path `path` (see the module docstring)."""
    import fcntl
    os.makedirs(cache_dir(), exist_ok=True)
    with open(os.path.join(cache_dir(), "turbospark-compile.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            purge_stale()
            child = None if is_warm(path) else _start("float", path)
            try:
                yield
            finally:
                if child is not None:
                    children.wait(child)
            _mark(path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _start(group, path):
    """The pid of the child process compiling `group` into the cache, or None where it cannot start
    (children.spawn: this also runs on gevent's loading thread)."""
    try:
        with open(os.devnull, "wb") as null:
            return children.spawn([sys.executable, "-m", "turbospark_wsgi.engine.kernels.warm", group, path],
                                  null.fileno())
    except OSError:
        return None


def _mark(path):
    try:
        with open(_marker(path), "w") as f:
            f.write("compiled\n")
    except OSError:
        pass


def main(argv=None):
    """`warm [GROUP] [ISA]`: compiles GROUP (int8, float, or all) on instruction path ISA (default: the
    CPU's best)."""
    from . import cpu, int8
    argv = sys.argv[1:] if argv is None else argv
    group = argv[0] if argv else "all"
    path = argv[1] if len(argv) > 1 else int8.DEFAULT.path
    groups = cpu.WARM_GROUPS if group == "all" else (group,)
    seconds = cpu.warmup(path, groups)
    print(f"compiled {', '.join(groups)} kernels for {path} in {seconds:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
