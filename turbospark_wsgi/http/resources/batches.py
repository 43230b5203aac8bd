"""The Batch API: /v1/files (upload, list, retrieve, delete, content) and /v1/batches (create,
retrieve, list, cancel), each file and batch its creating key's (another key gets 404)."""
from ...errors import InvalidRequest, NotFound, PayloadTooLarge, UnsupportedMediaType
from ..middleware import ReadDeadline, caller, read_json
from ..schemas import batches

UPLOAD_TIMEOUT = 10     # times the body timeout an upload may take (a batch file is large)


def _file_missing(file_id, param=None):
    return NotFound(f"No such File object: {file_id}", param=param, code="file_not_found")


def _batch_missing(batch_id):
    return NotFound(f"No batch found with id '{batch_id}'.", code="batch_not_found")


def _filename(part):
    """The upload's file name as a safe basename ("file" when it has none a path could not abuse)."""
    try:
        return part.secure_filename if part.filename else "file"
    except Exception:           # NOTE(name): falcon refuses a name that is empty once made safe
        return "file"


class Files:
    """POST /v1/files (multipart: `purpose` and `file`) and GET /v1/files."""

    def __init__(self, store, body_timeout):
        self._store, self._timeout = store, body_timeout * UPLOAD_TIMEOUT

    def on_post(self, req, resp):
        media = (req.content_type or "").split(";")[0].strip().lower()
        if media != "multipart/form-data":
            raise UnsupportedMediaType(f"Content-Type must be multipart/form-data, got '{media or 'none'}'")
        self._store.check()
        purpose = filename = data = None
        with ReadDeadline(req.env, self._timeout) as deadline:
            for part in req.get_media():
                if part.name == "purpose":
                    purpose = part.stream.read(64).decode("utf-8", "replace").strip()
                elif part.name == "file":
                    filename = _filename(part)
                    data = part.stream.read(self._store.file_bytes + 1)
                    if len(data) > self._store.file_bytes:
                        raise PayloadTooLarge(f"The file is over the limit of {self._store.file_bytes} bytes "
                                              "(TURBOSPARK_BATCH_FILE_BYTES)", param="file")
                else:
                    part.stream.read()
            if deadline.expired:
                raise deadline.error()
        if purpose not in batches.PURPOSES:
            raise InvalidRequest(f"'purpose' must be one of {', '.join(batches.PURPOSES)}", param="purpose")
        if data is None:
            raise InvalidRequest("Missing required parameter: 'file'", param="file")
        resp.media = self._store.put_file(caller(req).owner, filename, purpose, data)

    def on_get(self, req, resp):
        self._store.check()
        purpose = req.get_param("purpose")
        files = self._store.files(caller(req).owner, purpose)
        if req.get_param("order", default="desc") == "desc":
            files.reverse()
        resp.media = batches.page(files, req.get_param("after"), batches.parse_limit(req.get_param("limit"),
                                                                                    10000, 10000))


class FileItem:
    """GET / DELETE /v1/files/{file_id}."""

    def __init__(self, store):
        self._store = store

    def on_get(self, req, resp, file_id):
        meta = self._store.file(caller(req).owner, file_id)
        if meta is None:
            raise _file_missing(file_id)
        resp.media = meta

    def on_delete(self, req, resp, file_id):
        if not self._store.delete_file(caller(req).owner, file_id):
            raise _file_missing(file_id)
        resp.media = {"id": file_id, "object": "file", "deleted": True}


class FileContent:
    """GET /v1/files/{file_id}/content: the file's bytes as uploaded (JSONL for a batch's output)."""

    def __init__(self, store):
        self._store = store

    def on_get(self, req, resp, file_id):
        data = self._store.content(caller(req).owner, file_id)
        if data is None:
            raise _file_missing(file_id)
        resp.content_type = "application/octet-stream"
        resp.data = data


class Batches:
    """POST /v1/batches and GET /v1/batches."""

    def __init__(self, store, max_body, wake):
        self._store, self._max_body, self._wake = store, max_body, wake

    def on_post(self, req, resp):
        request = batches.parse_batch(read_json(req, self._max_body))
        who = caller(req)
        owner = who.owner
        self._store.check()
        meta = self._store.file(owner, request.input_file_id)
        if meta is None:
            raise _file_missing(request.input_file_id, "input_file_id")
        if meta["purpose"] != "batch":
            raise InvalidRequest(f"File {request.input_file_id} was uploaded with purpose '{meta['purpose']}'; a "
                                 "batch reads a file of purpose 'batch'", param="input_file_id")
        record = batches.new_batch(request)
        # NOTE(sender): its lines run as this key (its digest kept, never the key) from this address
        self._store.create_batch(owner, record, {"key": who.digest.hex() if who.digest else None,
                                                 "address": who.address})
        self._wake()
        resp.media = record

    def on_get(self, req, resp):
        self._store.check()
        resp.media = batches.page(self._store.batches(caller(req).owner), req.get_param("after"),
                                  batches.parse_limit(req.get_param("limit"), 20, 100))


class BatchItem:
    """GET /v1/batches/{batch_id}."""

    def __init__(self, store):
        self._store = store

    def on_get(self, req, resp, batch_id):
        record = self._store.batch(caller(req).owner, batch_id)
        if record is None:
            raise _batch_missing(batch_id)
        resp.media = record


class BatchCancel:
    """POST /v1/batches/{batch_id}/cancel: `cancelling` until its runner stops (lines already
    finished stay in the output file), then `cancelled`."""

    def __init__(self, store, wake):
        self._store, self._wake = store, wake

    def on_post(self, req, resp, batch_id):
        record = self._store.request_cancel(caller(req).owner, batch_id)
        if record is None:
            raise _batch_missing(batch_id)
        self._wake()
        resp.media = record
