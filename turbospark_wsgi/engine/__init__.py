"""The engine's public API: the only names the rest of the package imports.

    engine = load_engine("model.gguf" or "hf_dir/", device="auto")
    ids = engine.encode(text, add_bos=engine.add_bos)     # BOS where the model asks for one
    for event in engine.generate(ids, SamplingParams(...), should_stop=cancel.is_set, client=key):
        ...   # Prefill, Token (Paused while it waits for a row), then one Finish

Each `next()` on the generator does at most one prefill chunk or one decode step, so a caller may
drive it one step at a time from a compute thread. Up to `max_batch` runs of one Engine share each
decode step (engine/scheduler.py), and up to `max_paused` more wait paused beside them, the rows
shared fairly between clients; all of them are driven from that one thread.
"""
from .events import ConstraintError, Finish, FinishReason, Paused, Prefill, QueryTooLong, Scores, Token
from .options import EngineOptions

__all__ = ["Engine", "EngineOptions", "load_engine", "SamplingParams", "FinishReason", "Paused", "Prefill", "Scores",
           "Token", "Finish", "ConstraintError", "QueryTooLong", "release_scratch"]


def __getattr__(name):  # keep `import turbospark_wsgi.engine` cheap: numpy/tokenizers load on first use
    if name in ("Engine", "load_engine"):
        from . import engine
        return getattr(engine, name)
    if name == "SamplingParams":
        from .sampling import SamplingParams
        return SamplingParams
    if name == "release_scratch":       # the calling thread's C-kernel scratch (kernels/native.py)
        from .kernels.native import release_scratch
        return release_scratch
    raise AttributeError(name)
