"""The WSGI entry point: `gunicorn -c gunicorn.conf.py` loads `turbospark_wsgi.wsgi:app`."""
from .app import create_app
from .config import Config

app = create_app(Config.from_env())
