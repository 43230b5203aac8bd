"""The Batch API's runner: one thread per worker process that takes a batch's lease and sends its
lines through this same app, in this process, as its key's own requests at background priority.

    runner = BatchRunner(app, store, config); runner.start()    # after fork (create_app)
    runner.wake()                                                # a batch was created or cancelled

NOTE(same-path): a line is a real request to the app (WSGI, no socket): the route's own checks,
the key's auth, limits and quotas, the model's template and the renderers are those of a live
request, so a line's output is what the same request sent live gets (greedy: byte for byte).
NOTE(priority): its Caller is `background`: the queue grants it a slot only while a slot is free
and no live request waits, and the engine leaves it out of any step where a live prompt prefills.
NOTE(resume): a line's result is appended before the next line starts; a runner that claims a
batch skips every line with a result, so a worker killed mid-batch (SIGKILL included: the lease
is the kernel's flock, or a Redis key that expires) resumes on any worker without running a
finished line twice. Lines that were running when it died run again.
NOTE(retry): a line refused for the moment (429: the key's limits; 503: a full or loading server)
is not a result: it waits its Retry-After and goes again, until the batch's window ends.
"""
import hashlib
import io
import json
import logging
import os
import sys
import threading
import time
import weakref

from .. import metrics
from ..errors import StoreUnavailable
from ..serving import priority
from ..serving.batch_store import FINAL, KINDS
from .middleware import BATCH_CALLER, Caller
from .schemas import batches

log = logging.getLogger("turbospark.batches")

POLL = 2.0                  # s between looks for batches to run (a create or cancel here wakes it at once)
SAVE_EVERY = 1.0            # s between writes of a running batch's counts
RETRY_MOST = 10.0           # s a refused line waits at most before it goes again
DRAINING = "server_shutting_down"
IDLE_EXIT = 30.0            # s with no active batch after which a disk store's runner thread ends (a create
                            # starts it again); with Redis it keeps looking, for batches another replica left
_runners = weakref.WeakSet()


def stop_all():
    """Every runner of this process stops after its running lines (shutdown; the tests' end)."""
    for runner in list(_runners):
        runner.stop()


def output_file_id(batch_id, kind):
    """The id of a batch's output or error file: fixed, so a finalize done again writes the same file."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


class BatchRunner:
    def __init__(self, app, store, config, clock=time.time):
        self._app, self._store, self._clock = app, store, clock
        self._lines_at_once = config.batch_concurrency
        self._most = config.batch_max_lines
        self._woken = threading.Event()
        self._lock = threading.Lock()
        self._pid = None
        self._keep_looking = not getattr(store.backend, "root", None)     # Redis: other replicas' batches
        self.stopped = False
        _runners.add(self)

    def start(self):
        """Starts this process's runner thread (once per process; none when concurrency is 0)."""
        with self._lock:
            if self._lines_at_once and not self.stopped and self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._loop, name="turbospark-batches", daemon=True).start()

    def wake(self):
        self.start()
        self._woken.set()

    def stop(self):
        self.stopped = True
        self._woken.set()

    def _loop(self):
        busy = time.monotonic()
        while not self.stopped:
            try:
                if self.run_pending() or self._store.active():
                    busy = time.monotonic()
            except StoreUnavailable as e:
                log.warning("batches wait for their store: %s", e.message)
            except Exception:
                log.exception("the batch runner failed; it looks again in %g s", POLL)
            self._woken.wait(POLL)
            with self._lock:
                if not self._woken.is_set() and not self._keep_looking and time.monotonic() - busy > IDLE_EXIT:
                    self._pid = None        # NOTE(idle): the next wake() starts a new thread
                    return
                self._woken.clear()

    def run_pending(self):
        """Runs every active batch no other runner holds, to its end or its stop; True if one ran."""
        ran = False
        for batch_id in self._store.active():
            if self.stopped:
                break
            lease = self._store.claim(batch_id)
            if lease is None:
                continue
            try:
                ran = True
                self._run(batch_id, lease)
            finally:
                lease.release()
        return ran

    def _run(self, batch_id, lease):
        doc = self._store.stored(batch_id)
        if doc is None:
            self._store.drop_active(batch_id)
            return
        record = doc["record"]
        if record["status"] in FINAL:
            self._store.save(doc)
            return
        data = self._store.content(doc["owner"], record["input_file_id"])
        lines, fatal = batches.parse_input(data, record["endpoint"], self._most) if data is not None else (
            [], [{"code": "file_not_found", "message": f"The input file {record['input_file_id']} was deleted",
                  "param": "input_file_id", "line": None}])
        now = int(self._clock())
        if fatal:
            record.update(status="failed", failed_at=now, errors={"object": "list", "data": fatal})
            metrics.record_batch("failed")
            self._store.save(doc)
            return
        if record["status"] == "validating":
            record.update(status="in_progress", in_progress_at=now)
        record["request_counts"]["total"] = len(lines)
        progress = _Progress(self._store, doc)
        pending = [line for line in lines if line.index not in progress.done]
        stop = self._lines(pending, doc, progress, lease)
        if stop == "lost":
            return              # NOTE(lease): another runner has it now; its counts win
        if stop == DRAINING:
            progress.save()
            return              # NOTE(shutdown): resumes on the next start, its finished lines kept
        self._finalize(doc, stop, lines)

    def _lines(self, pending, doc, progress, lease):
        """Runs `pending` lines, a few at once; the reason it stopped: None (all done), "cancelled",
        "expired", "lost" (the lease) or DRAINING (the server is shutting down)."""
        work, lock, stop = iter(pending), threading.Lock(), []
        record = doc["record"]

        def stopping():
            if not stop:
                if self.stopped:
                    stop.append(DRAINING)
                elif self._store.cancel_asked(record["id"]) is not None:
                    stop.append("cancelled")
                elif self._clock() >= record["expires_at"]:
                    stop.append("expired")
                elif not lease.renew():
                    stop.append("lost")
            return bool(stop)

        def worker():
            while True:
                with lock:
                    if stopping():
                        return
                    line = next(work, None)
                if line is None:
                    return
                result = self._one(line, doc, record["endpoint"], stopping)
                if result is None:
                    return
                progress.add(line.index, *result)

        threads = [threading.Thread(target=worker, name="turbospark-batch-line", daemon=True)
                   for _ in range(max(1, min(self._lines_at_once, len(pending))))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return stop[0] if stop else None

    def _one(self, line, doc, endpoint, stopping):
        """(kind, line) for one request: its output or error line; None when the batch stops first."""
        if line.problem is not None:
            return "error", batches.failed_line(line.custom_id, *line.problem)
        while True:
            priority.live.hold_back()       # NOTE(priority): its template and tokens wait for a live arrival
            status, headers, body = self.call(doc, endpoint, line.body)
            if status not in (429, 503):
                break
            if _code(body) == DRAINING:
                self.stop()
                return None
            metrics.record_batch_retry()
            wait = min(RETRY_MOST, float(headers.get("retry-after") or 1))
            end = time.monotonic() + wait
            while time.monotonic() < end:
                if stopping():
                    return None
                time.sleep(min(0.25, end - time.monotonic()))
        kind = "output" if 200 <= status < 300 else "error"
        return kind, batches.output_line(line.custom_id, status, headers.get("x-request-id"), body)

    def call(self, doc, path, body):
        """(status, headers, body) of one request sent through the app as the batch's key."""
        return send(self._app, doc.get("sender") or {}, path, body)

    def _finalize(self, doc, stop, lines):
        record, batch_id = doc["record"], doc["record"]["id"]
        now = int(self._clock())
        record.update(status="finalizing", finalizing_at=now)
        self._store.save(doc)
        order = {line.index: i for i, line in enumerate(lines)}
        counts, found = record["request_counts"], {}
        for kind in KINDS:
            results = sorted(self._store.results(batch_id, kind), key=lambda r: order.get(r[0], r[0]))
            found[kind] = [line for _, line in results]
            record[f"{kind}_file_id"] = None
            if results:
                data = "".join(line + "\n" for line in found[kind]).encode("utf-8")
                file_id = output_file_id(batch_id, kind)
                self._store.put_file(doc["owner"], f"{batch_id}_{kind}.jsonl", f"batch_{kind}", data, file_id, now)
                record[f"{kind}_file_id"] = file_id
        counts.update(completed=len(found["output"]), failed=len(found["error"]))
        record["usage"] = batches.usage_of(found["output"])
        final = {None: "completed", "cancelled": "cancelled", "expired": "expired"}[stop]
        record.update({"status": final, f"{final}_at": now})
        metrics.record_batch(final)        # NOTE(order): counted before a client can see it final
        self._store.save(doc)
        log.info("batch %s %s: %d done, %d failed of %d", batch_id, final, counts["completed"], counts["failed"],
                 counts["total"])


def send(app, sender, path, body):
    """(status, lower-case headers, parsed body) of POST `path` with JSON `body` through the WSGI
    `app`, in this thread, as `sender` ({"key": its sha256 in hex or None, "address"}) at background
    priority."""
    key = bytes.fromhex(sender["key"]) if sender.get("key") else None
    address = sender.get("address") or "batch"
    who = Caller(key, address, "key:" + key.hex()[:16] if key else "addr:" + address, background=True)
    raw = json.dumps(body, ensure_ascii=False).encode("utf-8")
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": path, "SCRIPT_NAME": "", "QUERY_STRING": "",
               "SERVER_NAME": "batch", "SERVER_PORT": "0", "SERVER_PROTOCOL": "HTTP/1.1",
               "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(raw)), "REMOTE_ADDR": address,
               "wsgi.input": io.BytesIO(raw), "wsgi.errors": sys.stderr, "wsgi.url_scheme": "http",
               "wsgi.version": (1, 0), "wsgi.multithread": True, "wsgi.multiprocess": True,
               "wsgi.run_once": False, BATCH_CALLER: who}
    answer = {}

    def start_response(status, headers, exc_info=None):
        answer["status"], answer["headers"] = int(status[:3]), {k.lower(): v for k, v in headers}

    result = app(environ, start_response)
    try:
        payload = b"".join(result)
    finally:
        if hasattr(result, "close"):
            result.close()
    try:
        parsed = json.loads(payload) if payload else None
    except ValueError:
        parsed = {"error": {"message": payload[:500].decode("utf-8", "replace"), "type": "server_error"}}
    return answer["status"], answer["headers"], parsed


class _Progress:
    """A running batch's results: each appended as it comes, the counts written now and then."""

    def __init__(self, store, doc):
        self._store, self._doc = store, doc
        self._lock = threading.Lock()
        self._saved = 0.0
        batch_id = doc["record"]["id"]
        output, errors = store.results(batch_id, "output"), store.results(batch_id, "error")
        self.done = {i for i, _ in output} | {i for i, _ in errors}
        doc["record"]["request_counts"].update(completed=len(output), failed=len(errors))
        self.save()

    def add(self, index, kind, line):
        with self._lock:
            if index in self.done:
                return
            self._store.append(self._doc["record"]["id"], kind, index, line)
            metrics.record_batch_line(kind)
            self.done.add(index)
            self._doc["record"]["request_counts"]["completed" if kind == "output" else "failed"] += 1
            if time.monotonic() - self._saved >= SAVE_EVERY:
                self.save()

    def save(self):
        self._saved = time.monotonic()
        self._store.save(self._doc)


def _code(body):
    return ((body or {}).get("error") or {}).get("code") if isinstance(body, dict) else None
