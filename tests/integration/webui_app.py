"""A WSGI entry for the chat page's browser test: the real app and gunicorn around the suite's fake
engine, whose reply holds Markdown and an HTML payload and arrives one byte per step, slowly enough
that the page can be stopped mid-answer."""
import importlib.util
from pathlib import Path

from turbospark_wsgi.http.app import create_app
from turbospark_wsgi.config import Config
from turbospark_wsgi.serving.registry import Registry
from turbospark_wsgi.serving.service import Service

_spec = importlib.util.spec_from_file_location("suite_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)

PAYLOAD = "<img src=x onerror=alert(1)>"
REASONING = "The user wants the first steps."
REPLY = (f"<think>{REASONING}</think>Markup from a model stays text: {PAYLOAD}\n\n"
         "Three steps:\n\n- open the page\n- pick a model\n- ask\n\n"
         "```python\nprint('hello')\n```\n\n" + "And the answer goes on, one byte at a time. " * 40)
STEP_DELAY = 0.01


def _load(path, options=None, name=None):
    # NOTE(failing): a model file named failing.gguf fails mid-answer, for the page's error path
    fail_at = 80 if Path(path).stem == "failing" else None
    return _suite.FakeEngine(name=name or "fake", reply=REPLY, max_context=4096, step_delay=STEP_DELAY,
                             fail_at=fail_at)


config = Config.from_env()
app = create_app(config, service=Service(config, Registry(config, loader=_load)))
