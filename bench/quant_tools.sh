#!/usr/bin/env bash
# Quantized checkpoints written by the real tools, each in a venv of its own under build/ (made
# on first use, a minute or two), with the CPU torch Baton pins installed first and held there:
#
#     bench/quant_tools.sh /abs/float-ckpt /abs/out --schemes fp8_dynamic,w4a16 --group-size 64
#     bench/quant_tools.sh --gptqmodel /abs/float-ckpt /abs/out --schemes gptq,gptq_act
#
# llm-compressor (bench/quant_tools.py): 0.14 pins transformers <= 5.17 and compressed-tensors
# 0.19, which Baton's venv does not have (build/quant-tools-venv, BATON_QUANT_TOOLS_VENV).
# GPTQModel (bench/quant_gptqmodel.py, build/gptqmodel-venv, BATON_GPTQMODEL_VENV): 7.7 asks
# torch >= 2.14.1 but quantizes on CPU with 2.13, so it goes in without its requirements, which
# follow, torch held back.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TORCH=torch==2.13.0

fresh_venv() {  # fresh_venv DIR: a venv with torch (the pin in DIR/torch-pin.txt)
    echo "making $1" >&2
    "${PYTHON:-python3}" -m venv "$1"
    echo "$TORCH" > "$1/torch-pin.txt"
    "$1/bin/pip" install -q "$TORCH" >&2
}

if [ "${1:-}" = "--gptqmodel" ]; then
    shift
    VENV=${BATON_GPTQMODEL_VENV:-$ROOT/build/gptqmodel-venv}
    if ! "$VENV/bin/python" -c "import gptqmodel" >/dev/null 2>&1; then
        fresh_venv "$VENV"
        "$VENV/bin/pip" install -q --no-deps --no-build-isolation gptqmodel==7.7.0 >&2
        reqs=$("$VENV/bin/python" - <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
for line in requires("gptqmodel"):
    r = Requirement(line)
    if r.name != "torch" and (r.marker is None or r.marker.evaluate({"extra": ""})):
        print(line.split(";")[0])
PY
)
        # shellcheck disable=SC2086
        "$VENV/bin/pip" install -q -c "$VENV/torch-pin.txt" $reqs >&2
    fi
    exec "$VENV/bin/python" "$ROOT/bench/quant_gptqmodel.py" "$@"
fi
VENV=${BATON_QUANT_TOOLS_VENV:-$ROOT/build/quant-tools-venv}
if ! "$VENV/bin/python" -c "import llmcompressor" >/dev/null 2>&1; then
    fresh_venv "$VENV"
    "$VENV/bin/pip" install -q -c "$VENV/torch-pin.txt" llmcompressor==0.14.0.1 >&2
fi
exec "$VENV/bin/python" "$ROOT/bench/quant_tools.py" "$@"
