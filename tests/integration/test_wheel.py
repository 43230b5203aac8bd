"""The package as a deployment installs it: a wheel built from this checkout (and one built from its
sdist: the same files) holds every file of the package, and installed into a fresh virtualenv it
serves a chat answer and the chat page with `turbospark serve` run from a directory outside the
checkout. The fresh venv borrows the test venv's third-party packages through a .pth line (which
does not run the test venv's editable-install hook), so it imports this package from the wheel only."""
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from ops_servers import free_port, request
from turbospark_wsgi.pull import default_model_path

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def build_wheel(source, out):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(out), str(source)], check=True, cwd=out,
                    capture_output=True, timeout=300)
    wheels = list(Path(out).glob("turbospark_wsgi-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def package_files():
    """Every file of the package in this checkout (git's list; the tree when git is absent)."""
    try:
        out = subprocess.run(["git", "ls-files", "turbospark_wsgi"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = [str(p.relative_to(REPO)) for p in (REPO / "turbospark_wsgi").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts]
    return sorted(out)


def contents(wheel):
    with zipfile.ZipFile(wheel) as z:
        return sorted(n for n in z.namelist() if not n.split("/")[0].endswith(".dist-info"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel of a copy of the checkout's files (pip builds in the source tree: not in this one)."""
    source = tmp_path_factory.mktemp("source")
    for name in package_files() + ["setup.cfg", "pyproject.toml", "README.md"]:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    return build_wheel(source, tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_every_file_of_the_package_and_the_sdist_builds_the_same(wheel, tmp_path):
    files = contents(wheel)
    assert files == package_files()
    for data in ("turbospark_wsgi/engine/gpu/kernels.cu", "turbospark_wsgi/engine/kernels/native.c",
                 "turbospark_wsgi/http/static/index.html", "turbospark_wsgi/http/gunicorn_settings.py"):
        assert data in files, data
    sdist_dir = tmp_path / "sdist"
    subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                    "print(b.build_sdist(sys.argv[1]))", str(sdist_dir)], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    (sdist,) = sdist_dir.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    (root,) = (tmp_path / "unpacked").iterdir()
    out = tmp_path / "from-sdist"
    out.mkdir()
    assert contents(build_wheel(root, out)) == files


def test_a_wheel_install_serves_from_any_directory(wheel, tmp_path):
    model = default_model_path()
    if not model.is_file():
        pytest.skip(f"{model} absent")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", "--disable-pip-version-check", str(wheel)], check=True, capture_output=True,
                   timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("TURBOSPARK_")}
    where = subprocess.run([str(python), "-c", "import turbospark_wsgi; print(turbospark_wsgi.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(site), where

    port = free_port()
    log = tmp_path / "serve.log"
    env.update(TURBOSPARK_PORT=str(port), TURBOSPARK_MODELS=str(model.parent), TURBOSPARK_DEVICE="cpu",
               PYTHONUNBUFFERED="1")
    with log.open("wb") as out:
        proc = subprocess.Popen([str(venv / "bin" / "turbospark"), "serve"], cwd=elsewhere, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while request(port, "GET", "/health", timeout=5)[0] != 200:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        status, _, body = request(port, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        reply = json.loads(body)
        assert reply["choices"][0]["message"]["content"].strip(), reply
        status, headers, page = request(port, "GET", "/")
        assert status == 200 and b"<html" in page.lower()
        assert str(REPO) not in log.read_text()          # nothing of the checkout was used
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
