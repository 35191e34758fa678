#!/usr/bin/env bash
# The vLLM test environment (make vllm-env): vLLM 0.33.0's pure-Python sources and
# the packages they import, in a folder of their own that the vLLM tests put on
# PYTHONPATH. Nothing goes into the project's venv, and nothing here replaces its
# torch: every package the venv already has (torch, numpy, anyio...) is left out, so
# vLLM runs on the venv's copy.
#
#   scripts/vllm_env.sh [VENV [TARGET]]     defaults: .venv .vllm-env
#
# TARGET/site is the folder for PYTHONPATH; TARGET/site/.complete marks a finished
# install by this version of the script (a second run with it present does nothing;
# a changed script installs again).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv}
TARGET=${2:-.vllm-env}
VLLM_VERSION=0.33.0
PIP="$VENV/bin/pip"
PY="$VENV/bin/python"
SITE="$TARGET/site"
STAMP="$SITE/.complete"

# What vLLM's scheduler side imports, found by importing it on a CPU-only machine.
REQUIREMENTS=(
    psutil regex pydantic cachetools requests cbor2 transformers aiohttp openai
    openai-harmony pybase64 cloudpickle uvloop py-cpuinfo xgrammar llguidance einops
    "fastapi<0.137" starlette partial-json-parser
)
# Pulled in by the requirements above but not used on the scheduler side, and too big
# to carry: triton (torch's GPU compiler).
LEAVE_OUT=(triton)

if [[ ! -x "$PY" ]]; then
    echo "vllm_env.sh: no venv at $VENV (run make install first)" >&2
    exit 2
fi
SCRIPT_SUM=$(sha256sum "$0" | cut -d' ' -f1)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$SCRIPT_SUM" ]]; then
    echo "vLLM $VLLM_VERSION test environment: $SITE (already installed)"
    exit 0
fi

rm -rf "$SITE"
mkdir -p "$TARGET/download" "$SITE"

# 1. vLLM's sources: the wheel's Python files only (its compiled parts are not used).
wheel=$(ls "$TARGET"/download/vllm-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [[ -z "$wheel" ]]; then
    "$PIP" download --quiet --no-deps "vllm==$VLLM_VERSION" -d "$TARGET/download"
    wheel=$(ls "$TARGET"/download/vllm-"$VLLM_VERSION"-*.whl | head -n 1)
fi
"$PY" - "$wheel" "$SITE" <<'PYEOF'
import sys
import zipfile

wheel, site = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as archive:
    names = [
        name
        for name in archive.namelist()
        if name.startswith("vllm/") and name.endswith((".py", ".json", ".jinja"))
    ]
    archive.extractall(site, names)
print(f"unpacked {len(names)} files of {wheel}")
PYEOF

# 2. What the sources import: resolve against the venv's torch (so no CUDA build is
# chosen), then install exactly those versions, minus what the venv already has.
torch_version=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
"$PIP" install --quiet --dry-run --ignore-installed --report "$TARGET/report.json" \
    "${REQUIREMENTS[@]}" "torch==$torch_version"
mapfile -t pins < <("$PY" - "$TARGET/report.json" "${LEAVE_OUT[@]}" <<'PYEOF'
import json
import sys
from importlib import metadata

def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")

report = json.load(open(sys.argv[1]))
leave_out = {canonical(name) for name in sys.argv[2:]}
present = {canonical(dist.metadata["Name"]) for dist in metadata.distributions()}
for item in report["install"]:
    name = canonical(item["metadata"]["name"])
    if name not in present and name not in leave_out:
        print(f"{name}=={item['metadata']['version']}")
PYEOF
)
"$PIP" install --quiet --no-deps --target "$SITE" "${pins[@]}"
rm -rf "$SITE/bin"

# 3. It imports: vLLM's scheduler side loads with the venv's torch.
PYTHONPATH="$SITE" VLLM_TARGET_DEVICE=cpu "$PY" -c '
import torch, vllm
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
print("vLLM", vllm.__version__, "with torch", torch.__version__, "from", torch.__file__)
'
echo "$SCRIPT_SUM" > "$STAMP"
echo "vLLM $VLLM_VERSION test environment: $SITE (${#pins[@]} packages besides vLLM)"
