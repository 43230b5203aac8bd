#!/usr/bin/env bash
# Fills tools/wheels/ with what tools/gpu_check.py installs on a device machine that lacks it
# (it reaches no package index): falcon, gunicorn, gguf and its dependencies as pure-Python
# wheels, pyyaml and llguidance for CPython 3.10-3.13 on x86_64 Linux. About 6 MB; not committed
# (tools/wheels/ is ignored): run this before handing the working tree to the device.
set -euo pipefail
cd "$(dirname "$0")"
PIP="${PYTHON:-python3} -m pip"
mkdir -p wheels
$PIP download -q --no-deps --only-binary=:all: --platform any --implementation py --python-version 3.10 \
    -d wheels falcon gunicorn gguf tqdm requests certifi idna urllib3 charset-normalizer
for v in 3.10 3.11 3.12 3.13; do
    $PIP download -q --no-deps --only-binary=:all: --implementation cp --python-version "$v" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d wheels pyyaml llguidance
done
du -sh wheels
