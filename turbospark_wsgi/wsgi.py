"""The WSGI entry point: `gunicorn -c gunicorn.conf.py` loads `turbospark_wsgi.wsgi:app`."""
from .config import Config, thread_wait_env
from .http.app import create_app

thread_wait_env()              # before the first kernel loads libgomp
app = create_app(Config.from_env())
