#!/usr/bin/env bash
# The wheels `baton serve` imports at start that a GPU machine's image lacks (it has torch,
# transformers, grpcio, protobuf, aiohttp, prometheus-client, pyyaml), for CPython 3.12 on
# manylinux x86_64, into .whl/ at the repository's root. bench/gpu_perf.py's serve section
# unpacks them into a temporary folder at the front of the server's and client's PYTHONPATH
# (nothing is installed on the machine). The versions are this repository's venv's.
#
# protobuf comes too: baton/v1's generated code needs a 7.35.1 runtime at least, whatever the
# image has. NIXL (the engine core makes a NIXL agent even when colocated) weighs 59 MB as
# published; its wheel is trimmed here to what a UCX agent loads (no expert-parallel kernels,
# tools or other transfer plugins), about 22 MB. pillow (7 MB) reads images for vision-language
# models (gpu_check's vision check). grpcio is left out (the image's is taken;
# baton/v1 needs 1.85.1 or later): WITH_GRPCIO=1 adds it (about 7 MB).
#
#     bench/gpu_wheels.sh          # then carry .whl (ignored: echo /.whl/ >> .git/info/exclude)
#     PYVER=3.11 bench/gpu_wheels.sh   # wheels for this machine's Python instead (to try them here)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYVER=${PYVER:-3.12}
TAG=cp${PYVER/./}
rm -rf .whl
mkdir -p .whl
pkgs=(grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 googleapis-common-protos==1.76.0 protobuf==7.36.2
      msgspec==0.22.0 pyzmq==27.3.0 nixl==1.5.1 nixl-cu13==1.5.1 pillow==13.0.0)
if [ "${WITH_GRPCIO:-0}" = 1 ]; then
  pkgs+=(grpcio==1.85.3)
fi
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pkgs[@]}"
# NIXL trimmed: its wheel rewritten without what a colocated server's UCX agent never loads.
"$PY" - "$(ls .whl/nixl_cu13-*-"$TAG"-*.whl)" <<'EOF'
import os
import sys
import zipfile

path = sys.argv[1]


def dropped(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return (name.startswith(("nixl_ep_cu13/", "nixl_cu13.scripts/")) or "/ucx/libucx_perftest" in name
            or (base.startswith("libplugin_") and "UCX" not in base))


with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if not dropped(item.filename):
            dst.writestr(item, src.read(item.filename))
os.replace(path + ".tmp", path)
EOF
ls -la .whl
du -cb .whl/*.whl | tail -1 | awk '{printf "total: %.1f MiB\n", $1 / 1048576}'
