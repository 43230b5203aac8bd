"""An app's collaborators (http/deps.py) are its own: create_app takes them, the app carries them,
the worker finds them through the app it loaded; no module global holds the last app built."""
import functools
import os
import subprocess
import sys
import textwrap

import pytest

from turbospark_wsgi.engine import yielding
from turbospark_wsgi.http import app as app_module
from turbospark_wsgi.http import deps as deps_module
from turbospark_wsgi.http import refusal as refusal_module
from turbospark_wsgi.http import workers
from turbospark_wsgi.http.app import create_app, early_refusal
from turbospark_wsgi.http.deps import AppDeps, deps_of
from turbospark_wsgi.serving import compute

MODULES = (app_module, deps_module, refusal_module, compute, yielding)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def own_deps(harness, nice):
    """Deps of the harness's own: its refusal, a door on a fake clock whose waits go to `deps.waits`."""
    clock, waits = Clock(), []
    door = compute.FrontDoor(clock=clock, sleep=clock.sleep, on_wait=waits.append)
    deps = AppDeps(compute.ComputeSettings(nice=nice, give_way=True), door,
                   early_refusal(harness.config, harness.service))
    return deps, waits


def test_two_apps_in_one_process_keep_their_own_refusal_and_door(make_harness):
    full, roomy = make_harness(max_waiting=0), make_harness(max_waiting=1)
    full_deps, full_waits = own_deps(full, nice=3)
    roomy_deps, roomy_waits = own_deps(roomy, nice=7)
    full_app = create_app(full.config, full.service, full_deps)
    roomy_app = create_app(roomy.config, roomy.service, roomy_deps)     # built last: it must not win
    assert deps_of(full_app) is full_deps and deps_of(roomy_app) is roomy_deps
    holders = [full.service.queue.enqueue(), roomy.service.queue.enqueue()]
    try:
        assert deps_of(full_app).refusal.answer("POST", "/v1/completions", []).status.startswith("503")
        assert deps_of(roomy_app).refusal.answer("POST", "/v1/completions", []) is None
    finally:
        for holder in holders:
            holder.release()
    deps_of(full_app).door.claim()
    full_deps.door()
    roomy_deps.door()
    assert full_waits and not roomy_waits


def test_create_app_builds_its_own_deps_from_the_config(make_harness):
    one, two = make_harness(compute_nice=2, front_door=False), make_harness()
    first, second = deps_of(one.app()), deps_of(two.app())
    assert first.compute == compute.ComputeSettings(nice=2, give_way=False)
    assert second.compute == compute.ComputeSettings(nice=two.config.compute_nice, give_way=True)
    assert first.door is not second.door and first.refusal is not second.refusal
    assert first.door.on_wait is second.door.on_wait is not None     # both go to the metrics


def test_create_app_installs_nothing_in_a_module(make_harness):
    for module, names in ((refusal_module, ("install", "refusal", "_installed")),
                          (compute, ("configure", "front_door", "_door", "_nice", "_give_way"))):
        assert not [name for name in names if hasattr(module, name)], module.__name__
    compute.executor()                      # the process's one thread, made by now in any order
    before = [dict(vars(m)) for m in MODULES]
    made_with = compute._compute.made_with
    h = make_harness(max_waiting=0)
    deps, _ = own_deps(h, nice=9)
    create_app(h.config, h.service, deps)
    after = [dict(vars(m)) for m in MODULES]
    for module, old, new in zip(MODULES, before, after):
        changed = sorted(k for k in old.keys() | new.keys() if old.get(k, KeyError) is not new.get(k, KeyError))
        assert not changed, (module.__name__, changed)
    assert compute._compute.made_with is made_with     # NOTE(one-thread): started once, left as it was


def test_the_first_app_in_a_process_starts_the_compute_thread_with_its_deps(tmp_path):
    code = textwrap.dedent("""
        from turbospark_wsgi.config import Config
        from turbospark_wsgi.engine import yielding
        from turbospark_wsgi.http.app import create_app
        from turbospark_wsgi.http.deps import deps_of
        config = Config(models_dir=MODELS, load_default=False, data_dir=MODELS + "/data", compute_nice=0)
        first, second = create_app(config), create_app(config)
        print(yielding._gate is deps_of(first).door, yielding._gate is deps_of(second).door)
    """).replace("MODELS", repr(str(tmp_path)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.stdout.split() == ["True", "False"], out.stderr


class Wrapper:
    """WSGI middleware that names the app it wraps `app`."""

    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        return self.app(environ, start_response)


def test_the_deps_are_found_through_middleware_and_not_made_up(make_harness):
    app = make_harness().app()
    wrapped = functools.wraps(app)(lambda environ, start_response: app(environ, start_response))
    assert deps_of(Wrapper(wrapped)) is deps_of(app) is not None
    assert deps_of(lambda environ, start_response: []) is None
    loop = Wrapper(None)
    loop.app = loop
    assert deps_of(loop) is None


class Loaded:
    """Stands in for gunicorn's Worker.load_wsgi: the app it names becomes `self.wsgi`."""

    def __init__(self, app):
        self.loaded = app

    def load_wsgi(self):
        self.wsgi = self.loaded


class Worker(workers._ProcessSetup, Loaded):
    pass


@pytest.mark.parametrize("wrap", [lambda app: app, Wrapper], ids=["app", "wrapped"])
def test_a_worker_takes_the_refusal_and_door_of_the_app_it_loads(make_harness, wrap):
    app = make_harness().app()
    worker = Worker(wrap(app))
    worker.load_wsgi()
    assert worker.early is deps_of(app).refusal and worker.door is deps_of(app).door


def test_a_worker_serving_another_app_refuses_nothing_early():
    worker = Worker(lambda environ, start_response: [])
    worker.load_wsgi()
    assert worker.early is None and isinstance(worker.door, compute.FrontDoor)
