"""DESIGN §2 import rules, read from each module's imports with `ast`."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "turbospark_wsgi"

# Layers, outermost first (a module imports only from its own layer or below); a module belongs to
# the layer of the longest dotted name here that starts its own.
LAYERS = {
    5: ("wsgi", "cli", "__main__", "http.workers", "http.framing", "http.gunicorn_settings"),
    4: ("http.app", "http.deps", "http.middleware", "http.refusal", "http.resources", "http.batch_runner"),
    3: ("http.schemas", "http.sse", "http.parsers"),
    2: ("serving", "errors", "config", "pull", "metrics", "logsafe"),
    1: ("engine",),
}
# The folders that name the rooms, and what each may hold: the HTTP edge (layers 3-5), the serving
# core (2), the engine (1); the package root keeps the entries and the operations every room uses.
ROOMS = {"http": {3, 4, 5}, "serving": {2}, "engine": {1}}
ROOT = {"__init__", "__main__", "wsgi", "cli", "config", "errors", "metrics", "logsafe", "pull"}
TOP_LEVEL = {"__init__", "http.__init__", "serving.__init__"}   # the package's and rooms' __init__: no imports


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield ".".join(path.relative_to(PACKAGE).with_suffix("").parts), path


def imports(name, path):
    """Absolute names imported by a module: 'numpy', 'turbospark_wsgi.engine', ..."""
    package = ["turbospark_wsgi"] + name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)    # `from . import x`: x may be a module
    return found


def top(name):
    return name.split(".")[0]


def layer_of(name):
    best = None
    for layer, names in LAYERS.items():
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (layer, prefix)
    return best[0] if best else None


ALL = list(modules())
IDS = [n for n, _ in ALL]


@pytest.mark.parametrize("name, path", ALL, ids=IDS)
def test_every_module_has_a_layer(name, path):
    assert name in TOP_LEVEL or layer_of(name) is not None, f"{name}: add it to a layer in DESIGN §2 and here"


@pytest.mark.parametrize("name, path", ALL, ids=IDS)
def test_imports_go_down_or_sideways_only(name, path):
    mine = layer_of(name)
    if mine is None:
        return
    for imp in imports(name, path):
        if imp.startswith("turbospark_wsgi.") and (target := layer_of(imp[len("turbospark_wsgi."):])):
            assert target <= mine, f"{name} (L{mine}) imports {imp} (L{target})"


@pytest.mark.parametrize("name, path", ALL, ids=IDS)
def test_third_party_rules(name, path):
    third = {top(i) for i in imports(name, path) if not i.startswith("turbospark_wsgi")}
    if "falcon" in third:
        assert layer_of(name) in (4, 5), f"{name} imports falcon outside L4/L5"
    for lib in ("numpy", "tokenizers", "jinja2", "cupy", "cupyx", "gguf", "torch"):
        if lib in third:
            assert top(name) == "engine", f"{name} imports {lib} outside engine/"


@pytest.mark.parametrize("name, path", ALL, ids=IDS)
def test_engine_and_resources_boundaries(name, path):
    inside = {i for i in imports(name, path) if i.startswith("turbospark_wsgi")}
    if top(name) == "engine":
        stray = {i for i in inside if not i.startswith("turbospark_wsgi.engine")}
        assert not stray, f"{name} reaches outside engine/: {stray}"
    if name.startswith("http.resources"):
        assert not {i for i in inside if i.startswith("turbospark_wsgi.engine")}, f"{name} imports the engine"
    assert not any(top(i) == "tools" or i.startswith("tests") for i in imports(name, path)), name


def test_schemas_import_nothing_from_the_engine():
    """The schemas carry the request's checked fields (serving.params.Sampling); the engine's params
    are built at admission, once the prompt's token budget is known."""
    for name, path in ALL:
        if name.startswith(("http.schemas", "http.sse")):
            engine = {i for i in imports(name, path) if i.startswith("turbospark_wsgi.engine")}
            assert not engine, f"{name} imports {sorted(engine)}"


def _name(node):
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _calls(name, path, called, first_arg=None):
    """'module:line' of each call to a function named `called` (with a first argument whose name
    ends in `first_arg`)."""
    return [f"{name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and _name(node.func) == called
            and (first_arg is None or node.args and _name(node.args[0]).endswith(first_arg))]


def test_a_request_becomes_sampling_params_in_one_place():
    """One construction, after the token budget is known (vLLM's `to_sampling_params`): the schemas
    check the fields, serving/params.py builds the engine's params, and what differs per choice (its
    seed, its constraint) goes beside them to the run, never in a rebuilt copy. The engine, which
    defines the type, also builds the empty params of a prompt it only scores."""
    built = [site for name, path in ALL if top(name) != "engine" for site in _calls(name, path, "SamplingParams")]
    assert len(built) == 1 and built[0].startswith("serving.params:"), built
    rebuilt = [site for name, path in ALL for site in _calls(name, path, "replace", first_arg="params")]
    assert not rebuilt, rebuilt


def test_the_package_import_is_light():
    """The service layer loads without falcon, cupy, tokenizers or jinja2 (CLI and tools stay quick)."""
    import subprocess
    import sys
    code = ("import sys, turbospark_wsgi, turbospark_wsgi.config, turbospark_wsgi.serving.service;"
            "print(sorted(m for m in ('falcon', 'cupy', 'tokenizers', 'jinja2') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name, path", ALL, ids=IDS)
def test_each_module_lives_in_its_room(name, path):
    """The folder a module stands in names its layer: the HTTP edge in http/, admission, queueing
    and generation in serving/, the model in engine/, entries and operations at the root."""
    room = name.split(".")[0]
    if room in ROOMS:
        assert name in TOP_LEVEL or layer_of(name) in ROOMS[room], f"{name}: layer {layer_of(name)} in {room}/"
    else:
        assert name in ROOT, f"{name}: the package root holds only {sorted(ROOT)}; put it in a room"


def test_each_room_says_its_job():
    """Every module opens with a docstring: the one job of its room."""
    for name, path in ALL:
        if name.startswith("engine"):
            continue
        assert ast.get_docstring(ast.parse(path.read_text())), f"{name} has no module docstring"


def package_graph():
    """module -> the package's modules it imports (lazy imports inside functions included)."""
    names = {name for name, _ in ALL}
    graph = {}
    for name, path in ALL:
        targets = set()
        for imp in imports(name, path):
            if not imp.startswith("turbospark_wsgi."):
                continue
            mod = imp[len("turbospark_wsgi."):]
            while mod and mod not in names:         # `from .x import Name`: the module is x
                mod = mod.rpartition(".")[0]
            if mod and mod != name and not name.startswith(mod + "."):     # a package's own __init__
                targets.add(mod)
        graph[name] = targets
    return graph


def test_no_import_circles():
    graph, done, path = package_graph(), set(), []

    def visit(node):
        if node in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        path.append(node)
        for target in sorted(graph.get(node, ())):
            visit(target)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


MAX_CLASS_LINES = 200


@pytest.mark.parametrize("name, path", list(modules()))
def test_no_class_outgrows_a_screenful_or_two(name, path):
    """A class past 200 lines holds more than one job: split it along a seam (weights from the
    forward pass, framing from dispatch), not into mixins."""
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not long, f"{name}: {long}"


SHARED_ROOT = ("config", "errors", "logsafe", "metrics", "pull")


@pytest.mark.parametrize("name, path", [(n, p) for n, p in ALL if n in SHARED_ROOT])
def test_the_roots_shared_modules_lean_on_no_room_above_the_engine(name, path):
    """What every room uses (settings, errors, metrics) imports nothing from serving/ or http/, so a
    serving module that reads the config never climbs back up through the root to serving."""
    inside = {i for i in imports(name, path) if i.startswith(("turbospark_wsgi.serving", "turbospark_wsgi.http"))}
    assert not inside, f"{name} imports {sorted(inside)}"


def _defined(tree, in_classes):
    """Names of the functions a module defines: those in its classes (`in_classes`), or all of them."""
    nodes = [n for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in c.body] if in_classes else ast.walk(tree)
    return {n.name for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _library_names(modules):
    """What the classes of the libraries `modules` import (the standard library's, third parties')
    have: the methods a serving module may call on their objects (a logger's `error`)."""
    import builtins
    import importlib
    names = {a for t in vars(builtins).values() if isinstance(t, type) for a in dir(t)}
    for lib in sorted({i for name, path in modules for i in imports(name, path) if not i.startswith("turbospark_wsgi")}):
        try:
            module = importlib.import_module(lib)
        except Exception:       # noqa: BLE001 - `from x import name` names no module; an extra not installed
            continue
        names |= {a for v in vars(module).values() if isinstance(v, type) for a in dir(v)}
    return names


def http_only_methods():
    """{method name: the http/ modules whose classes define it}, for the names no module outside
    http/ defines as a function or method, and no class of a library serving/ imports has."""
    elsewhere = _library_names([(n, p) for n, p in ALL if top(n) == "serving"])
    http = {}
    for name, path in ALL:
        tree = ast.parse(path.read_text())
        if top(name) == "http":
            for method in _defined(tree, in_classes=True):
                http.setdefault(method, []).append(name)
        else:
            elsewhere |= _defined(tree, in_classes=False)
    return {m: where for m, where in http.items() if m not in elsewhere}


def test_serving_calls_no_method_only_http_defines():
    """An object of http/ handed into serving/ shows in no import, yet serving then leans on it:
    a serving module calling `x.name(...)`, where `name` is a method only classes under http/
    define, is working on an HTTP object. Hand serving plain data instead (DESIGN §2)."""
    only_http = http_only_methods()
    found = []
    for name, path in ALL:
        if top(name) != "serving":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in only_http:
                found.append(f"{name}:{node.lineno} calls .{node.func.attr}(), a method only "
                             f"{', '.join(only_http[node.func.attr])} defines")
    assert not found, "; ".join(found)
