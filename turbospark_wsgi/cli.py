"""`turbospark serve | pull | models | check`: argparse, then calls into the package."""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import pull as pulling
from .config import DEFAULT_MODEL, Config, ConfigError, env_name, setting_from_env

WSGI_APP = "turbospark_wsgi.wsgi:app"

# flag dest -> environment variable read by config.py (for gunicorn.conf.py and the workers)
SERVE_ENV = {dest: env_name(field) for dest, field in {
    "model": "model", "models_dir": "models_dir", "host": "host", "port": "port", "device": "device",
    "max_waiting": "max_waiting", "threads": "threads", "worker_class": "worker_class", "max_body": "max_body",
    "max_context": "max_context", "api_key": "api_keys", "guardrails": "guardrails"}.items()}


def build_parser():
    parser = argparse.ArgumentParser(prog="turbospark", description="OpenAI-compatible LLM server (WSGI).")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub.add_parser("serve", help="serve a model over HTTP with gunicorn"))
    p = sub.add_parser("pull", help="download a known model into the models directory")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                   help=f"one of: {', '.join(sorted(pulling.SOURCES))} (default %(default)s)")
    _models_dir_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress output")
    _models_dir_arg(sub.add_parser("models", help="list installed models (id, size, path, routes, weight storage, chat template)"))
    _check_parser(sub.add_parser("check", help="run one prompt through the engine, no HTTP"))
    p = sub.add_parser("warm", help="build the CPU kernels a model needs into the kernel cache (the C "
                                    "kernels, or numba's; e.g. at a container image's build), then exit")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name, id or path (pulled first when missing)")
    _models_dir_arg(p)
    return parser


def _models_dir_arg(p):
    p.add_argument("--models-dir", help="models directory (env TURBOSPARK_MODELS, "
                                        "default ~/.cache/turbospark/models)")


def _serve_parser(p):
    p.add_argument("--model", help=f"model name, id or path (default {DEFAULT_MODEL}, "
                                   "pulled first when missing)")
    _models_dir_arg(p)
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port (default 8000)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="array backend (default auto)")
    p.add_argument("--max-waiting", type=int, help="requests allowed to queue; more get 503")
    p.add_argument("--threads", type=int, help="gthread worker threads")
    p.add_argument("--worker-class", choices=["gthread", "gevent"], help="gunicorn worker (default gthread)")
    p.add_argument("--max-body", type=int, help="largest request body in bytes; larger get 413")
    p.add_argument("--max-context", type=int, help="cap on the context length in tokens")
    p.add_argument("--api-key", action="append", help="require this bearer key (repeatable)")
    p.add_argument("--guardrails", help="guardrails policy file (TOML; env TURBOSPARK_GUARDRAILS); "
                                        "SIGHUP reads it again")


def _check_parser(p):
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name, id or path")
    _models_dir_arg(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="array backend (default TURBOSPARK_DEVICE "
                                                                    "or auto); the other engine settings "
                                                                    "come from TURBOSPARK_* as the server's do")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")


def main(argv=None):
    args = build_parser().parse_args(argv)
    handler = {"serve": cmd_serve, "pull": cmd_pull, "models": cmd_models, "check": cmd_check, "warm": cmd_warm}
    try:
        return handler[args.command](args) or 0
    except (pulling.PullError, ConfigError) as exc:
        print(f"turbospark: {exc}", file=sys.stderr)
        return 1


def models_dir(args):
    return Path(args.models_dir).expanduser() if args.models_dir else pulling.default_models_dir()


# ---- serve ----------------------------------------------------------------------------------------

def cmd_serve(args):
    argv, env = serve_command(args)
    start_kernel_build(env)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)


def start_kernel_build(env):
    """Starts building the CPU's C kernels in a process of their own, while gunicorn starts and the
    worker imports and reads the model; the worker's load then waits for that build (its file lock)
    instead of starting one. Nothing where the settings take numba's kernels or the GPU.

    PERF(cold-start): the build takes 2.3-2.9 s (gcc 12 -O3, Zen 4) and a warm start about 2 s, which
    it now overlaps; returns the process, or None where it did not start."""
    try:
        settings = {name: setting_from_env(name, env) for name in ("kernels", "device", "int8_isa", "int8_vnni")}
    except ValueError:                      # ConfigError: the worker names the bad setting
        return None
    from .engine.options import INT8_PATHS
    if settings["kernels"] not in ("auto", "native") or settings["device"] == "cuda" \
            or settings["int8_isa"] not in INT8_PATHS:
        return None
    try:
        return subprocess.Popen([sys.executable, "-m", "turbospark_wsgi.engine.kernels.native", settings["int8_isa"],
                                 "1" if settings["int8_vnni"] else "0"], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return None


def serve_command(args, environ=None):
    """The gunicorn argv and environment for `serve`; pulls the model first when it is a known name."""
    env = dict(os.environ if environ is None else environ)
    for dest, var in SERVE_ENV.items():
        value = getattr(args, dest, None)
        if value is not None:
            env[var] = ",".join(value) if isinstance(value, list) else str(value)
    model = setting_from_env("model", env)
    if model in pulling.SOURCES:
        # NOTE(alias): the name stays in TURBOSPARK_MODEL; the registry maps it to the pulled file.
        pulling.pull(model, Path(setting_from_env("models_dir", env)))
    return [sys.executable, "-m", "gunicorn", "-c", str(gunicorn_conf()), WSGI_APP], env


def gunicorn_conf():
    """The gunicorn settings: the package's module, so a wheel install serves from any directory."""
    return "python:turbospark_wsgi.http.gunicorn_settings"


# ---- pull / models --------------------------------------------------------------------------------

def cmd_pull(args):
    print(pulling.pull(args.name, models_dir(args), progress=not args.quiet))


def cmd_models(args):
    from .engine.engine import chat_template_status
    from .engine.loader import weight_storage
    from .serving.registry import model_capabilities, model_kind

    rows = installed_models(models_dir(args))
    if not rows:
        print(f"no models in {models_dir(args)}; try `turbospark pull`", file=sys.stderr)
    for model_id, size, path in rows:
        kind = model_kind(str(path))
        template = chat_template_status(str(path)) if kind == "generation" else ""
        print(f"{model_id}\t{size / 2**20:.1f} MiB\t{path}\t{','.join(model_capabilities(kind))}\t"
              f"{weight_storage(str(path))}\t{template}")
    if rows:
        # on stderr: stdout stays one tab-separated row per model, for scripts
        print(f"CPU kernels (TURBOSPARK_ACTIVATIONS, TURBOSPARK_INT8_ISA): {_kernels()}", file=sys.stderr)


def _kernels():
    """What a model loaded with the environment's settings runs on this CPU, and why."""
    from .config import Config
    from .engine.options import kernel_plan
    return kernel_plan(Config.from_env().engine_options()).describe()


def _registry(directory, model=DEFAULT_MODEL):
    from .serving.registry import Registry

    return Registry(Config(models_dir=str(directory), model=model, load_default=False))


def installed_models(directory):
    """[(id, bytes, path)] for each model and alias the server would list from `directory`."""
    rows = []
    for info in sorted(_registry(directory).list(), key=lambda i: i.id):
        path = Path(info.path)
        size = path.stat().st_size if path.is_file() else \
            sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        rows.append((info.id, size, path))
    return rows


def resolve_model(name, directory):
    """A path for `name`: a known name (pulled if missing), an installed id or alias, or a path."""
    if name in pulling.SOURCES:
        pulling.pull(name, directory, progress=not pulling.target_path(name, directory).is_file())
    path = _registry(directory, model=name).find(name)
    if path is None:
        return pulling.pull(name, directory)      # raises, naming the known names
    return Path(path)


# ---- check ----------------------------------------------------------------------------------------

def cmd_check(args):
    from .engine import load_engine
    from .serving.params import Sampling, sampling_params

    options = Config.from_env().engine_options()
    engine = load_engine(resolve_model(args.model, models_dir(args)), options, device=args.device)
    if args.chat:
        prompt_ids = engine.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = engine.encode(args.prompt, add_bos=engine.add_bos)
    params = sampling_params(Sampling(temperature=args.temperature, seed=args.seed), args.max_tokens)
    result = run_check(engine, prompt_ids, params)
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
        t = result["timings"]
        print(f"[{result['finish_reason']}; prefill {t['prefill_tokens_per_s']:.1f} tok/s, "
              f"decode {t['decode_tokens_per_s']:.1f} tok/s]", file=sys.stderr)


def cmd_warm(args):
    """Loads the model as the server would (TURBOSPARK_* settings), which builds every kernel it runs
    into the kernel cache (the C kernels: kernels/native.py; numba's: kernels/warm.py); a server
    started later on this machine loads them."""
    from .engine.loader import load_model

    start = time.perf_counter()
    loaded = load_model(resolve_model(args.model, models_dir(args)), Config.from_env().engine_options())
    print(f"kernels ready in {time.perf_counter() - start:.1f} s: {loaded.kernels or loaded.backend}")


def run_check(engine, prompt_ids, params):
    """Drive one generation and time it: prefill ends at the first token."""
    tokens, texts, finish = [], [], None
    start = time.perf_counter()
    first = None
    for event in engine.generate(prompt_ids, params):
        kind = type(event).__name__
        if kind == "Token":
            first = first or time.perf_counter()
            tokens.append(event.id)
            texts.append(event.text)
        elif kind == "Finish":
            finish = event
            texts.append(event.text)
    end = time.perf_counter()
    first = first or end
    decoded = max(len(tokens) - 1, 0)
    return {
        "prompt_tokens": list(prompt_ids), "tokens": tokens, "text": "".join(texts),
        "finish_reason": finish.reason,
        "timings": {"prefill_s": first - start, "decode_s": end - first,
                    "prefill_tokens_per_s": len(prompt_ids) / max(first - start, 1e-9),
                    "decode_tokens_per_s": decoded / max(end - first, 1e-9) if decoded else 0.0},
    }
