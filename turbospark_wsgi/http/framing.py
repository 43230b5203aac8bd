"""Where a request's bytes end, by h11: the workers' early path reads heads and bodies with it.

`Framing` follows one request as its bytes arrive (fed the whole buffer each time; it reads only
what is new) and says what the worker may do: wait for more (`WAIT`), hand over a request that is
all in (`WHOLE`, with `end` its length and `head` its head when it is plain enough to answer
early), hand the bytes to the server's own reader (`SERVER`: framing that reader judges, or a
client that waits for `100 Continue`), or refuse it at once (`REFUSE`, with `refused`): a body that
the Content-Length or a chunk size already puts over the limit (413), a chunk size that no 64-bit
reader holds (400).

    framing = Framing(max_head=65536, max_body=4 << 20)
    while framing.feed(buf) is WAIT:
        buf += sock.recv(65536)
"""
import re
from dataclasses import dataclass
from typing import NamedTuple

import h11

WAIT, WHOLE, SERVER, REFUSE = "wait", "whole", "server", "refuse"
SIZE_LINE = 1024                # a longer chunk-size line (extensions included) is the reader's to refuse
CHUNKS = 4096                   # a body in more chunks than this is read on by a thread, never the loop
_PLAIN = re.compile(rb"[\t\r\n -~]*")       # printable ASCII and tab: the bytes of a head answered early
_BARE = re.compile(rb"(?<!\r)\n|\r\n[ \t]")  # a bare LF or a folded line: the server's reader judges those


class Head(NamedTuple):
    """A plain HTTP/1.x request head: upper-case method, origin-form path (query cut), CRLF lines of
    printable ASCII, within the server's limits; `fields` are (name, value) as sent."""
    method: str
    path: str
    version: int                # minor version: 0 or 1
    fields: list


@dataclass(frozen=True, slots=True)
class Refused:
    status: int                 # 400 or 413
    message: str


class Framing:
    def __init__(self, max_head, max_body, limits=None):
        """`max_head`: bytes a head may take; `max_body`: the body limit; `limits`: gunicorn's cfg,
        whose limit_request_line/_fields/_field_size a head answered early must keep."""
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head)
        self._max_body = max_body
        self._limits = limits
        self._fed = 0               # bytes of the buffer given to h11
        self._skip = 0              # one empty line before the request line, as gunicorn allows
        self._line_checked = False
        self._events = 0
        self._chunked = False
        self._open = False          # inside a chunk whose data is not all in
        self.request = None         # h11's Request once the head is in
        self.head = None            # its Head, when plain enough to answer without the server's parser
        self.size = 0               # body bytes read
        self.end = None             # bytes the request takes, once WHOLE
        self.refused = None         # Refused, once REFUSE
        self.state = WAIT

    @property
    def stage(self):
        return "body" if self.request is not None else "head"

    def feed(self, buf):
        """Reads what `buf` holds past what was fed before; the new state."""
        if self.state is not WAIT:
            return self.state
        if self._fed == 0 and buf[:2] in (b"\r", b"\r\n"):
            if len(buf) < 2:
                return self.state
            self._fed = self._skip = 2
        new = bytes(buf[self._fed:])
        if not new:
            return self.state
        self._fed += len(new)
        self._conn.receive_data(new)
        try:
            self.state = self._advance(buf)
        except h11.RemoteProtocolError:
            self.state = SERVER     # the server's reader answers it as it always has
        return self.state

    def _advance(self, buf):
        while True:
            event = self._conn.next_event()
            if event is h11.NEED_DATA:
                return self._need_data(buf)
            if isinstance(event, h11.Request):
                state = self._on_head(event, buf)
                if state is not WAIT:
                    return state
            elif isinstance(event, h11.Data):
                state = self._on_data(event, buf)
                if state is not WAIT:
                    return state
            elif isinstance(event, h11.EndOfMessage):
                self.end = self._fed - len(self._conn.trailing_data[0])
                return WHOLE
            else:
                return SERVER       # PAUSED or a connection event: nothing this path reads

    def _need_data(self, buf):
        if self.request is None:
            return self._check_line(buf)
        if self._chunked and len(self._conn.trailing_data[0]) > SIZE_LINE:
            return SERVER           # a size line (or trailer) with no end in sight
        return WAIT

    def _check_line(self, buf):
        """Judges the request line as soon as it is in, not once the head is: a line h11 refuses
        (an HTTP/0.9 `GET /`) is the server's to answer now, not after the header timeout."""
        if self._line_checked:
            return WAIT
        newline = buf.find(b"\n", self._skip)
        if newline < 0:
            return WAIT
        self._line_checked = True
        probe = h11.Connection(h11.SERVER)
        probe.receive_data(bytes(buf[self._skip:newline + 1]) + b"Host: h\r\n\r\n")
        try:
            probe.next_event()
        except h11.RemoteProtocolError:
            return SERVER
        return WAIT

    def _on_head(self, request, buf):
        self.request = request
        fields = request.headers.raw_items()
        names = {name.lower(): value for name, value in fields}   # h11 has refused unlike lengths
        self._chunked = b"transfer-encoding" in names
        head_end = self._fed - len(self._conn.trailing_data[0])
        self.head = plain_head(request, fields, bytes(buf[self._skip:head_end]), self._limits)
        length = 0 if self._chunked else int(names.get(b"content-length", 0))
        if length > self._max_body:
            return self._refuse(413, f"The request body is too large ({length} bytes; the limit is "
                                     f"{self._max_body})")
        if b"expect" in names:
            return SERVER           # the client waits for `100 Continue`: the server sends it
        return WAIT

    def _on_data(self, data, buf):
        self._events += 1
        opened, self._open = self._open, not data.chunk_end
        if self._chunked and not opened and not data.chunk_end:
            # NOTE(chunk-size): h11 keeps a chunk's declared size to itself. The first data of a chunk
            # not all in took every byte fed, so the chunk's size line ends where that data starts
            # (h11 has checked the line) and says how much is still to come. A size line whose data
            # has not begun waits, as any stalled body does.
            start = self._fed - len(data.data)
            line = bytes(buf[buf.rfind(b"\n", 0, start - 1) + 1:start - 2])
            declared = int(line.split(b";")[0].strip(b" \t") or b"0", 16)
            if declared >= 1 << 64:
                return self._refuse(400, "The request body could not be read: its chunk size is over 64 bits")
            if self.size + declared > self._max_body:
                return self._refuse(413, f"The request body is too large (at least {self.size + declared} "
                                         f"bytes; the limit is {self._max_body})")
        self.size += len(data.data)
        if self.size > self._max_body:
            return self._refuse(413, f"The request body is too large (at least {self.size} bytes; the limit "
                                     f"is {self._max_body})")
        if self._events >= CHUNKS and self._chunked:
            return SERVER           # NOTE(cost): a body of tiny chunks is a thread's to read
        return WAIT

    def _refuse(self, status, message):
        self.refused = Refused(status, message)
        return REFUSE


def plain_head(request, fields, raw, limits):
    """The request's Head when `raw` (its bytes; `fields` its (name, value) pairs as sent) is plain
    enough that the server's parser takes it as h11 did, else None."""
    if request.http_version not in (b"1.0", b"1.1") or not request.target.startswith(b"/"):
        return None
    method = request.method.decode("ascii")
    if not (method.isalpha() and method.isupper()) or not _PLAIN.fullmatch(raw) or _BARE.search(raw):
        return None
    if limits is not None:
        lines = raw.split(b"\r\n")
        if (0 < limits.limit_request_line < len(lines[0]) or 0 < limits.limit_request_fields < len(fields)
                or 0 < limits.limit_request_field_size < max(map(len, lines[1:]), default=0) + 2):
            return None
    path = request.target.decode("ascii").partition("?")[0]
    return Head(method, path, int(request.http_version[-1:]),
                [(name.decode("ascii"), value.decode("ascii")) for name, value in fields])


def parse_head(data, limits=None):
    """The plain Head at the start of `data`, or None (incomplete, refused, or not plain)."""
    framing = Framing(max_head=len(data) + 1, max_body=1 << 62, limits=limits)
    framing.feed(data)
    return framing.head
