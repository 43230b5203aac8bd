"""turbospark CLI: argparse wiring, the gunicorn command `serve` would exec, and `check --json`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turbospark_wsgi import cli
from turbospark_wsgi import pull as pulling

REPO = Path(__file__).resolve().parent.parent
STORIES = Path(os.environ.get("TURBOSPARK_TEST_MODELS", "/work/shared/models")) / "stories260K.gguf"
if not STORIES.is_file():
    STORIES = REPO.parent / "shared" / "models" / "stories260K.gguf"


@pytest.fixture
def pulls(monkeypatch, tmp_path):
    """Records pull() calls and answers with a path in tmp_path instead of downloading."""
    calls = []

    def fake_pull(name, directory, progress=True):
        calls.append((name, Path(directory)))
        return Path(directory) / pulling.SOURCES[name].filename

    monkeypatch.setattr(pulling, "pull", fake_pull)
    monkeypatch.setattr(cli, "gunicorn_conf", lambda: REPO / "gunicorn.conf.py")
    return calls


def serve(argv, environ=None):
    return cli.serve_command(cli.build_parser().parse_args(["serve", *argv]), environ=environ or {})


def test_serve_defaults_pull_the_default_model_and_exec_gunicorn(pulls, tmp_path):
    argv, env = serve([], {"TURBOSPARK_MODELS": str(tmp_path)})
    assert argv == [sys.executable, "-m", "gunicorn", "-c", str(REPO / "gunicorn.conf.py"), cli.WSGI_APP]
    assert pulls == [(pulling.DEFAULT_MODEL, tmp_path)]
    for var in ("TURBOSPARK_MODEL", "TURBOSPARK_HOST", "TURBOSPARK_PORT", "TURBOSPARK_THREADS"):
        assert var not in env                  # config.py's defaults apply


def test_serve_flags_become_environment(pulls, tmp_path):
    model = tmp_path / "m.gguf"
    argv, env = serve(["--model", str(model), "--host", "0.0.0.0", "--port", "9001",
                       "--models-dir", str(tmp_path), "--device", "cpu", "--max-waiting", "3",
                       "--threads", "12", "--worker-class", "gevent", "--max-body", "4096",
                       "--max-context", "1024", "--api-key", "k1", "--api-key", "k2"])
    assert pulls == []                         # a path is served as it is
    assert {k: v for k, v in env.items() if k.startswith("TURBOSPARK_")} == {
        "TURBOSPARK_MODEL": str(model), "TURBOSPARK_MODELS": str(tmp_path),
        "TURBOSPARK_HOST": "0.0.0.0", "TURBOSPARK_PORT": "9001", "TURBOSPARK_DEVICE": "cpu",
        "TURBOSPARK_MAX_WAITING": "3", "TURBOSPARK_THREADS": "12",
        "TURBOSPARK_WORKER_CLASS": "gevent", "TURBOSPARK_MAX_BODY": "4096",
        "TURBOSPARK_MAX_CONTEXT": "1024", "TURBOSPARK_API_KEYS": "k1,k2"}


def test_serve_pulls_a_named_model_and_keeps_the_name_for_the_registry(pulls, tmp_path):
    _, env = serve(["--model", "smollm2-135m-instruct", "--models-dir", str(tmp_path)])
    assert pulls == [("smollm2-135m-instruct", tmp_path)]
    assert env["TURBOSPARK_MODEL"] == "smollm2-135m-instruct"


def test_serve_keeps_operator_environment_when_no_flag_overrides_it(pulls):
    _, env = serve(["--port", "8100"], {"TURBOSPARK_PORT": "7000", "TURBOSPARK_THREADS": "20",
                                         "TURBOSPARK_MODEL": "/m/x.gguf"})
    assert (env["TURBOSPARK_PORT"], env["TURBOSPARK_THREADS"]) == ("8100", "20")
    assert env["TURBOSPARK_MODEL"] == "/m/x.gguf" and pulls == []


def test_serve_rejects_unknown_worker_class():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--worker-class", "sync"])


def test_serve_uses_the_packaged_settings_and_the_checkout_file_reads_the_same():
    import importlib
    import runpy

    assert cli.gunicorn_conf() == "python:turbospark_wsgi.http.gunicorn_settings"
    packaged = importlib.import_module("turbospark_wsgi.http.gunicorn_settings")
    checkout = runpy.run_path(str(REPO / "gunicorn.conf.py"))
    for name in ("bind", "worker_class", "threads", "timeout", "graceful_timeout", "logconfig_dict", "on_starting",
                 "when_ready", "post_worker_init", "child_exit"):
        assert name in checkout, name
        if not callable(checkout[name]):
            assert checkout[name] == getattr(packaged, name), name


def test_pull_unknown_name_fails_with_the_known_names(capsys, tmp_path):
    assert cli.main(["pull", "nope", "--models-dir", str(tmp_path)]) == 1
    assert pulling.DEFAULT_MODEL in capsys.readouterr().err


def test_models_lists_gguf_files_and_hf_directories(capsys, tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF" + b"\0" * 2044)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("ignored")
    assert cli.main(["models", "--models-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    lines = [line.split("\t") for line in out.out.splitlines()]
    assert "CPU kernels" in out.err and " activations" in out.err     # which kernels, and why
    assert [(row[0], row[2]) for row in lines] == [("a", str(tmp_path / "a.gguf")),
                                                   ("hf", str(tmp_path / "hf"))]
    assert lines[0][1] == "0.0 MiB"
    assert [row[4] for row in lines] == ["", ""]          # weight storage: neither has a tensor table


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "turbospark_wsgi", "--help"], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0 and "serve" in out.stdout


@pytest.fixture(scope="module")
def engine():
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} absent")
    try:
        from turbospark_wsgi.engine import load_engine
        return load_engine(STORIES, device="cpu")
    except ImportError as exc:
        pytest.skip(f"engine not importable yet: {exc}")


def test_check_json_matches_the_engine_run_directly(engine, capsys):
    from turbospark_wsgi.engine import SamplingParams, Token

    prompt = "Once upon a time"
    assert cli.main(["check", "--model", str(STORIES), "--prompt", prompt, "--max-tokens", "8",
                     "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == engine.encode(prompt, add_bos=True)
    assert out["prompt_tokens"][0] == engine.tokenizer.bos_id
    direct = [e.id for e in engine.generate(out["prompt_tokens"], SamplingParams(max_new_tokens=8,
                                                                                temperature=0.0))
              if isinstance(e, Token)]
    assert out["tokens"] == direct and 0 < len(direct) <= 8
    assert out["finish_reason"] in ("stop", "length")
    assert out["text"] == engine.decode(out["tokens"]) or out["finish_reason"] == "stop"
    assert out["timings"]["prefill_tokens_per_s"] > 0


def test_check_chat_uses_the_chat_template(engine, capsys):
    assert cli.main(["check", "--model", str(STORIES), "--prompt", "Hi", "--chat", "--max-tokens", "4",
                     "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == engine.apply_chat_template([{"role": "user", "content": "Hi"}])


# ---- the README's and docs/' tables stay true to the code -----------------------------------------

README = (REPO / "README.md").read_text()
REFERENCE = (REPO / "docs" / "configuration.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((REPO / "docs").glob("*.md"))}
README_MOST_LINES = 250


def test_the_readme_is_a_front_door_and_links_every_doc():
    assert len(README.splitlines()) <= README_MOST_LINES
    for name in DOCS:
        assert f"](docs/{name}" in README, name


def test_the_docs_relative_links_name_files_and_sections_that_exist():
    import re

    def anchors(text):
        return {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", text, re.M)}

    for name, text in [("README.md", README)] + [(f"docs/{n}", t) for n, t in DOCS.items()]:
        base = (REPO / name).parent
        for target, _, section in re.findall(r"\]\(([^)#:]*)(#([^)]*))?\)", text):
            if target.startswith("http") or not target and not section:
                continue
            path = (base / target).resolve() if target else REPO / name
            assert path.exists(), f"{name}: {target}"
            if section and path.suffix == ".md":
                assert section in anchors(path.read_text()), f"{name}: {target}#{section}"


def test_readme_documents_every_config_variable_and_serve_flag():
    """Every variable and flag in the configuration reference; the README names the main ones."""
    from dataclasses import fields

    from turbospark_wsgi.config import Config, env_name

    for f in fields(Config):
        if f.name != "load_default":
            assert f"`{env_name(f.name)}`" in REFERENCE, env_name(f.name)
    serve_parser = cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    for action in serve_parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}" in REFERENCE, flag
    for name in ("TURBOSPARK_MODEL", "TURBOSPARK_PORT", "TURBOSPARK_API_KEYS", "TURBOSPARK_MAX_BATCH"):
        assert f"`{name}`" in README


def test_readme_lists_every_route():
    import ast

    tree = ast.parse((REPO / "turbospark_wsgi" / "http" / "app.py").read_text())
    routes = [node.args[0].value for node in ast.walk(tree)
              if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_route"
              and isinstance(node.args[0], ast.Constant)]
    assert routes
    for route in routes:
        shown = route.replace("{model_id:path}", "{id}")
        assert f"{shown}`" in README or f"{shown}," in README, route


@pytest.mark.skipif(not STORIES.exists(), reason="stories260K.gguf not present")
def test_warm_compiles_a_models_kernels_and_says_which(capsys):
    assert cli.main(["warm", "--model", str(STORIES)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kernels ready in ") and "activations" in out


def test_serve_starts_the_c_kernel_build_beside_gunicorn(monkeypatch):
    """The build overlaps gunicorn's start (its file lock makes the worker wait for it); nothing is
    built where the settings take numba's kernels or the GPU, or name a bad value."""
    from turbospark_wsgi import cli
    started = []
    monkeypatch.setattr(cli.subprocess, "Popen", lambda argv, **kw: started.append((argv, kw)) or "proc")
    assert cli.start_kernel_build({"TURBOSPARK_INT8_ISA": "avx2", "TURBOSPARK_INT8_VNNI": "0"}) == "proc"
    argv, kw = started[0]
    assert argv[1:] == ["-m", "turbospark_wsgi.engine.kernels.native", "avx2", "0"] and kw["start_new_session"]
    for env in ({"TURBOSPARK_KERNELS": "numba"}, {"TURBOSPARK_DEVICE": "cuda"}, {"TURBOSPARK_KERNELS": "fortran"}):
        assert cli.start_kernel_build(env) is None
    assert len(started) == 1


def test_the_kernel_build_entry_builds_the_chosen_path(tmp_path, monkeypatch):
    from turbospark_wsgi.engine.kernels import native
    if native.compiler() is None:
        pytest.skip("no C compiler")
    built = []
    monkeypatch.setattr(native, "build", lambda path: built.append(path) or (str(tmp_path / "x.so"), True))
    assert native.main(["generic", "1"]) == 0 and built == ["generic"]
    monkeypatch.setattr(native, "build", lambda path: (_ for _ in ()).throw(native.NativeUnavailable("no cc")))
    assert native.main([]) == 1
