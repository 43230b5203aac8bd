"""gunicorn settings for TurboSpark WSGI: `gunicorn -c gunicorn.conf.py` (the app is wsgi_app below).

Bind address, threads and worker class come from TURBOSPARK_HOST / PORT / THREADS / WORKER_CLASS
(see turbospark_wsgi.config.Config). One worker per process-wide model and FIFO queue; each open
stream pins a gthread thread, so threads >= max_waiting + running + headroom.
"""
from turbospark_wsgi.config import Config

_config = Config.from_env()

wsgi_app = "turbospark_wsgi.wsgi:app"
bind = f"{_config.host}:{_config.port}"
worker_class = _config.worker_class
workers = 1                                  # one engine, one compute thread and one FIFO per process
threads = max(_config.threads, _config.max_waiting + 4)
worker_connections = max(100, threads)       # gevent: concurrent connections per worker
timeout = 30                                 # heartbeat only: engine work runs off the request threads
graceful_timeout = 600                       # let long generations finish on SIGTERM / reload
keepalive = 75                               # longer than nginx's upstream keepalive idle timeout
max_requests = 0                             # a request-count restart would cut streams and reload the model
preload_app = False                          # load the model post-fork: never touch CUDA in the master
control_socket_disable = True                # several instances (tests, CI) would fight over one socket
accesslog = None                             # the app writes one access line per request itself
loglevel = "info"
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "root": {"level": "INFO", "handlers": ["error_console"]},
    "loggers": {"turbospark": {"level": "INFO", "propagate": True}},
}
