"""gunicorn settings for TurboSpark WSGI, in the package so that a wheel install serves:
`turbospark serve` runs `gunicorn -c python:turbospark_wsgi.http.gunicorn_settings`; a checkout's
`gunicorn.conf.py` reads this module, so `gunicorn -c gunicorn.conf.py` works as well (the app is
wsgi_app below).

Bind address, threads and worker class come from TURBOSPARK_HOST / PORT / THREADS / WORKER_CLASS
(see turbospark_wsgi.config.Config). One worker per process-wide model and FIFO queue; each open
stream pins a gthread thread, so threads >= max_waiting + running + headroom.

Shutdown: on SIGTERM a worker stops accepting, answers every queued request at once with 503
"server shutting down" (an SSE error event for a stream already open), and lets running
generations finish within graceful_timeout (TURBOSPARK_GRACEFUL_TIMEOUT).

Reload: SIGHUP to the master re-reads TURBOSPARK_LIMITS_FILE and TURBOSPARK_GUARDRAILS in every
worker, in place: nothing
restarts, no stream or queued request is dropped. (gunicorn's own HUP would start new workers,
load the model again and stop the old ones with SIGTERM, which answers their queued requests 503.)
"""
import glob
import logging
import os
import resource
import signal
import threading

from turbospark_wsgi.config import Config
from turbospark_wsgi.logsafe import EscapeFilter

_config = Config.from_env()

wsgi_app = "turbospark_wsgi.wsgi:app"
bind = f"{_config.host}:{_config.port}"
# NOTE(slow-clients): gthread and gevent with request heads (and gthread with bodies) buffered off
# the worker threads and under deadlines: TURBOSPARK_HEADER_TIMEOUT / TURBOSPARK_BODY_TIMEOUT.
worker_class = {"gthread": "turbospark_wsgi.http.workers.ThreadWorker",
                "gevent": "turbospark_wsgi.http.workers.GeventWorker"}[_config.worker_class]
workers = 1                                  # one engine, one compute thread and one FIFO per process
threads = _config.threads                    # config.worker_threads: every open stream holds one
worker_connections = max(1000, threads)      # open connections per worker: a slow one costs a socket
timeout = 30                                 # heartbeat only: engine work runs off the request threads
graceful_timeout = int(_config.graceful_timeout)  # let running generations finish on SIGTERM / reload
keepalive = 75                               # longer than nginx's upstream keepalive idle timeout
max_requests = 0                             # a request-count restart would cut streams and reload the model
preload_app = False                          # load the model post-fork: never touch CUDA in the master
control_socket_disable = True                # several instances (tests, CI) would fight over one socket
accesslog = None                             # the app writes one access line per request itself
loglevel = "info"
# NOTE(log-injection): every line has its control characters escaped, so no request data can forge
# one: the app's lines through this handler's filter, gunicorn's own through on_starting's.
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"escape": {"()": "turbospark_wsgi.logsafe.EscapeFilter"}},
    "handlers": {"error_console": {"class": "logging.StreamHandler", "formatter": "generic",
                                   "stream": "ext://sys.stderr", "filters": ["escape"]}},
    "root": {"level": "INFO", "handlers": ["error_console"]},
    "loggers": {"turbospark": {"level": "INFO", "propagate": True}},
}


def on_starting(server):
    _raise_open_files(worker_connections + 256)
    # gunicorn's loggers keep handlers of their own (--error-logfile, --access-logfile, which the
    # dictConfig above would drop if it named them), so the filter goes on the loggers.
    for name in ("gunicorn.error", "gunicorn.access"):
        logging.getLogger(name).addFilter(EscapeFilter())
    # NOTE(metrics): samples left by a previous run would be summed into this one's.
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        os.makedirs(directory, exist_ok=True)
        for path in glob.glob(os.path.join(directory, "*.db")):
            os.remove(path)


def _raise_open_files(wanted):
    # NOTE(fds): worker_connections sockets plus model files and logs; a common soft limit is 1024,
    # and an accept() over it would end the worker. The soft limit may rise up to the hard one.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def when_ready(server):
    # NOTE(reload): gunicorn looks up `handle_hup` on the arbiter for each HUP; this one passes the
    # signal on to the workers instead of replacing them (a new worker would load the model again).
    def forward_hup():
        server.log.info("Hang up: reloading the limits and guardrails in every worker")
        server.kill_workers(signal.SIGHUP)

    server.handle_hup = forward_hup


def post_worker_init(worker):
    """SIGTERM: the queue drops its waiters with a 503 at once, then gunicorn's own handler stops
    accepting and waits for the running generation. SIGHUP: the limits and guardrails files are read
    again (a bad file keeps the policy in force and is logged)."""
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGHUP, lambda signum, frame: _off_handler(_reload_limits))
    signal.siginterrupt(signal.SIGHUP, False)

    def on_term(signum, frame):
        from turbospark_wsgi.serving.queue import shut_down_all

        # NOTE(signals): the queue's lock is taken on a fresh thread, never inside the handler, which
        # may have interrupted a holder of that lock. Under gevent the handler runs in a hub callback,
        # where Thread.start() would block: spawn a greenlet instead.
        _off_handler(shut_down_all)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_term)


def _reload_limits():
    from turbospark_wsgi.serving import guardrails, limits

    limits.reload_all()
    guardrails.reload_all()


def _off_handler(fn):
    """Runs `fn` outside the signal handler, which may have interrupted a holder of a lock it needs."""
    from turbospark_wsgi.serving.compute import gevent_patched

    if gevent_patched():
        import gevent
        gevent.spawn(fn)
    else:
        threading.Thread(target=fn, name="turbospark-signal", daemon=True).start()


def child_exit(server, worker):
    from turbospark_wsgi.metrics import mark_process_dead

    mark_process_dead(worker.pid)
