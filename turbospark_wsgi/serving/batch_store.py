"""Files and batches of the Batch API, kept where a restart finds them: on disk under the data
directory (TURBOSPARK_DATA), or in Redis (TURBOSPARK_REDIS) for every replica at once.

    store = open_batch_store(config)
    meta = store.put_file(owner, "in.jsonl", "batch", data)       # FileLimit (4xx) over a limit
    store.file(owner, file_id), store.content(owner, file_id)     # None: unknown or another owner's
    store.create_batch(owner, record); store.batch(owner, batch_id); store.request_cancel(owner, batch_id)
    lease = store.claim(batch_id)                                 # None: another runner has it
    store.append(batch_id, "output", line)                        # one finished line, durable at once
    store.results(batch_id, "output")                             # every line appended so far

NOTE(owner): every file and batch belongs to the key that created it (middleware.Caller.owner, a
digest); any other key finds nothing, exactly as for an id that never existed (404).
NOTE(durable): a finished line is appended (and, on disk, fsync'ed) before the next one starts, and
the batch's counts are recomputed from the appended lines when a runner claims it, so a worker
killed mid-batch loses no finished line and the next runner skips every one of them.
NOTE(one-logic): both backends offer the same few primitives (blobs, append-only line logs, id
indexes, leases); the Batch API's rules are written once, here, over them.
"""
import contextlib
import fcntl
import hmac
import json
import os
import re
import secrets
import threading
import time

from ..errors import InvalidRequest, PayloadTooLarge, StoreUnavailable

FILE_ID = re.compile(r"file-[0-9a-f]{24}\Z")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}\Z")
FINAL = ("completed", "failed", "expired", "cancelled")
KINDS = ("output", "error")


class FileLimit(InvalidRequest):
    """A key's upload over the files it may keep (TURBOSPARK_BATCH_MAX_FILES)."""

    code = "file_limit_exceeded"


def open_batch_store(config):
    """The Batch API's store: in Redis when `config.redis` is set, else under the data directory."""
    if config.redis:
        from .batch_store_redis import RedisBackend
        backend = RedisBackend(config.redis)
    else:
        backend = DiskBackend(data_dir(config))
    return BatchStore(backend, config.batch_file_bytes, config.batch_max_files)


def data_dir(config):
    """TURBOSPARK_DATA, else `data` beside the models directory."""
    return config.data_dir or os.path.join(os.path.dirname(os.path.abspath(config.models_dir)), "data")


def new_id(prefix):
    return prefix + secrets.token_hex(12)


class BatchStore:
    """The Batch API's rules (owners, limits, the cancel mark, leases) over a backend's primitives."""

    def __init__(self, backend, file_bytes, max_files):
        self.backend, self.file_bytes, self.max_files = backend, file_bytes, max_files
        self.name = backend.name

    def check(self):
        self.backend.check()

    # -- files ------------------------------------------------------------------------------------
    def put_file(self, owner, filename, purpose, data, file_id=None, created=None):
        """Keeps `data` as a file of `owner`; its OpenAI File object. `file_id`: a fixed id (a batch's
        output, written again unchanged when a finalize is redone)."""
        if len(data) > self.file_bytes:
            raise PayloadTooLarge(f"The file is {len(data)} bytes; the limit is {self.file_bytes} bytes "
                                  "(TURBOSPARK_BATCH_FILE_BYTES)", param="file")
        if file_id is None and self.max_files and len(self.files(owner)) >= self.max_files:
            raise FileLimit(f"This key already holds {self.max_files} files (TURBOSPARK_BATCH_MAX_FILES); "
                            "delete some first", param="file")
        meta = {"id": file_id or new_id("file-"), "object": "file", "bytes": len(data),
                "created_at": created or int(time.time()), "filename": filename, "purpose": purpose,
                "status": "processed", "expires_at": None, "status_details": None}
        self.backend.put(f"file/{meta['id']}.data", data)
        self.backend.put(f"file/{meta['id']}.json", _dump({"owner": owner, "meta": meta}))
        if file_id is None or not self.backend.indexed(f"files/{owner or '-'}", meta["id"]):
            self.backend.index_add(f"files/{owner or '-'}", meta["id"])
        return meta

    def file(self, owner, file_id):
        """The File object, or None (unknown, deleted or another owner's)."""
        doc = self._owned(owner, "file", file_id, FILE_ID)
        return doc["meta"] if doc else None

    def content(self, owner, file_id):
        if self.file(owner, file_id) is None:
            return None
        return self.backend.get(f"file/{file_id}.data")

    def files(self, owner, purpose=None):
        """`owner`'s File objects, oldest first."""
        found = []
        for file_id in self.backend.index(f"files/{owner or '-'}"):
            meta = self.file(owner, file_id)
            if meta is not None and (purpose is None or meta["purpose"] == purpose):
                found.append(meta)
        return found

    def delete_file(self, owner, file_id):
        if self.file(owner, file_id) is None:
            return False
        self.backend.delete(f"file/{file_id}.json")
        self.backend.delete(f"file/{file_id}.data")
        self.backend.index_remove(f"files/{owner or '-'}", file_id)
        return True

    # -- batches ----------------------------------------------------------------------------------
    def create_batch(self, owner, record, sender=None):
        """Keeps a new batch; `sender`: what its lines run as ({"key": the key's sha256 in hex or None,
        "address"}), so they pass the same auth and limits as the key's own requests."""
        self.backend.put(f"batch/{record['id']}.json", _dump({"owner": owner, "record": record, "sender": sender}))
        self.backend.index_add(f"batches/{owner or '-'}", record["id"])
        self.backend.index_add("active", record["id"])

    def batch(self, owner, batch_id):
        """The Batch object as a client sees it (a cancel asked for shows as `cancelling`), or None."""
        doc = self._owned(owner, "batch", batch_id, BATCH_ID)
        return self._shown(batch_id, doc["record"]) if doc else None

    def batches(self, owner):
        """`owner`'s batches, newest first."""
        ids = reversed(self.backend.index(f"batches/{owner or '-'}"))
        return [b for b in (self.batch(owner, i) for i in ids) if b is not None]

    def request_cancel(self, owner, batch_id):
        """Marks the batch for cancelling (its runner ends it); the Batch object, or None."""
        record = self.batch(owner, batch_id)
        if record is not None and record["status"] not in FINAL:
            self.backend.put(f"batch/{batch_id}.cancel", str(int(time.time())).encode())
            record = self.batch(owner, batch_id)
        return record

    def cancel_asked(self, batch_id):
        raw = self.backend.get(f"batch/{batch_id}.cancel")
        return int(raw) if raw else None

    def stored(self, batch_id):
        """A batch's stored document ({"owner", "record", "sender"}) for its runner, whoever owns it;
        None when gone."""
        raw = self.backend.get(f"batch/{batch_id}.json") if BATCH_ID.match(batch_id) else None
        return json.loads(raw) if raw is not None else None

    def save(self, doc):
        """Writes the runner's view of a batch; a final one leaves the active index."""
        batch_id = doc["record"]["id"]
        self.backend.put(f"batch/{batch_id}.json", _dump(doc))
        if doc["record"]["status"] in FINAL:
            self.backend.index_remove("active", batch_id)

    def drop_active(self, batch_id):
        self.backend.index_remove("active", batch_id)

    def active(self):
        """Ids of the batches not yet final, oldest first (for the runners)."""
        return self.backend.index("active")

    def claim(self, batch_id):
        """A lease on running the batch, or None while another runner holds it. Its result logs
        lose a line cut short by a killed writer."""
        lease = self.backend.lease(f"batch/{batch_id}.lock")
        if lease is not None:
            for kind in KINDS:
                self.backend.trim(f"batch/{batch_id}.{kind}")
        return lease

    def append(self, batch_id, kind, index, line):
        """Records the result of the batch's request `index` (its output or error line)."""
        self.backend.append(f"batch/{batch_id}.{kind}", f"{index} {line}".encode("utf-8") + b"\n")

    def results(self, batch_id, kind):
        """[(index, line)] of every result recorded so far."""
        found = []
        for raw in self.backend.lines(f"batch/{batch_id}.{kind}"):
            index, _, line = raw.decode("utf-8").partition(" ")
            found.append((int(index), line))
        return found

    def _shown(self, batch_id, record):
        if record["status"] not in FINAL and record["status"] != "cancelling":
            asked = self.cancel_asked(batch_id)
            if asked is not None:
                record = dict(record, status="cancelling", cancelling_at=asked)
        return record

    def _owned(self, owner, kind, item_id, pattern):
        if not isinstance(item_id, str) or not pattern.match(item_id):
            return None                 # NOTE(paths): only ids of this form ever name a stored item
        raw = self.backend.get(f"{kind}/{item_id}.json")
        if raw is None:
            return None
        doc = json.loads(raw)
        return doc if hmac.compare_digest(doc["owner"], owner) else None


def _dump(doc):
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


class DiskBackend:
    """The primitives as files under `root`: writes replace a file atomically, appends are fsync'ed,
    a lease is an exclusive flock (the kernel drops it when its process dies, however it dies)."""

    def __init__(self, root):
        self.root = root
        self.name = f"batch store ({root})"
        self._lock = threading.Lock()

    def check(self):
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"The {self.name} cannot be used: {e.strerror}", retry_after=5) from None

    def _path(self, name):
        path = os.path.join(self.root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def put(self, name, data):
        path = self._path(name)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def get(self, name):
        try:
            with open(os.path.join(self.root, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def delete(self, name):
        try:
            os.unlink(os.path.join(self.root, name))
            return True
        except FileNotFoundError:
            return False

    def append(self, name, data):
        fd = os.open(self._path(name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def lines(self, name):
        raw = self.get(name) or b""
        return raw.split(b"\n")[:-1]     # NOTE(torn): a last line without its newline is not finished

    def trim(self, name):
        """Cuts a torn last line (a writer killed mid-append) so the next append starts clean."""
        path = os.path.join(self.root, name)
        raw = self.get(name)
        if raw and not raw.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(raw.rfind(b"\n") + 1)

    def index(self, name):
        seen = {}
        for line in self.lines(f"index/{name}"):
            item, _, op = line.decode().partition(" ")
            if op == "-":
                seen.pop(item, None)
            else:
                seen.setdefault(item, True)
        return list(seen)

    def indexed(self, name, item):
        return item in self.index(name)

    def index_add(self, name, item):
        with self._index_lock(name):
            self.append(f"index/{name}", f"{item} +\n".encode())

    def index_remove(self, name, item):
        with self._index_lock(name):
            self.append(f"index/{name}", f"{item} -\n".encode())
            kept = self.index(name)
            if len(self.lines(f"index/{name}")) > 2 * len(kept) + 64:
                self.put(f"index/{name}", "".join(f"{i} +\n" for i in kept).encode())   # compacted

    @contextlib.contextmanager
    def _index_lock(self, name):
        """The index's writers, in every process, one at a time (a compaction replaces the file)."""
        with self._lock:
            fd = os.open(self._path(f"index/{name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def lease(self, name):
        fd = os.open(self._path(name), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return _FileLease(fd)


class _FileLease:
    def __init__(self, fd):
        self._fd = fd

    def renew(self):
        return self._fd is not None

    def release(self):
        if self._fd is not None:
            os.close(self._fd)          # NOTE(flock): closing the descriptor drops the lock
            self._fd = None
