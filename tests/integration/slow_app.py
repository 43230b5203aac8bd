"""A WSGI entry for shutdown tests: the real app, gunicorn and queue around the test suite's fake
engine, slowed to TURBOSPARK_TEST_STEP_DELAY seconds per token so that streams overlap a signal."""
import importlib.util
import os
from pathlib import Path

from turbospark_wsgi.http.app import create_app
from turbospark_wsgi.config import Config
from turbospark_wsgi.serving.registry import Registry
from turbospark_wsgi.serving.service import Service

_spec = importlib.util.spec_from_file_location("suite_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)
DELAY = float(os.environ.get("TURBOSPARK_TEST_STEP_DELAY", "0.05"))


def _load(path, options=None, name=None):
    return _suite.FakeEngine(name=name or "fake", reply="abcdefghij" * 10, max_context=256, step_delay=DELAY)


config = Config.from_env()
app = create_app(config, service=Service(config, Registry(config, loader=_load)))
