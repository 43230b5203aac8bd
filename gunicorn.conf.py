"""gunicorn settings for a checkout: `gunicorn -c gunicorn.conf.py turbospark_wsgi.wsgi:app`.

The settings and hooks live in the package (turbospark_wsgi/http/gunicorn_settings.py), which a
wheel install has too. NOTE(fresh): that file is run anew on each read rather than imported, so
every read sees the environment of that moment, as gunicorn's own reading of a file does.
"""
import importlib.util
import runpy

_settings = runpy.run_path(importlib.util.find_spec("turbospark_wsgi.http.gunicorn_settings").origin)
globals().update({k: v for k, v in _settings.items() if not k.startswith("__")})
