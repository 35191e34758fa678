#!/usr/bin/env bash
# GPU check of the data plane: the `gpu` tests of tests/transfer, then the cuda
# transfer benchmark (one JSON object per line). Runs in under 8 minutes.
#
# It installs nothing that is not already on the machine except this project:
# a virtualenv with --system-site-packages reuses the CUDA build of torch (and
# numpy, msgspec, pytest) that is already there; the project goes in with
# --no-deps --no-index (or, failing that, through PYTHONPATH). A missing
# dependency is installed only from a wheel directory that travels with the
# project ($GPU_CHECK_WHEELS, default ./wheels), never from an index.
#
#   scripts/gpu_check.sh            # exit 2 when there is no CUDA device
#   GPU_CHECK_BACKEND=cpu scripts/gpu_check.sh   # dry run of the script itself
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
BACKEND=${GPU_CHECK_BACKEND:-cuda}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/wheels}
VENV=${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/tiering-gpu-check-venv}
OUT=${OUT:-}
START=$(date +%s)

log() { printf '[gpu_check %3ss] %s\n' "$(($(date +%s) - START))" "$*" >&2; }

has_cuda_torch() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

# 1. A python whose torch sees the GPU: $PYTHON, the project's .venv, python3.
BASE=""
for candidate in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
    [[ -n $candidate ]] && command -v "$candidate" >/dev/null 2>&1 || continue
    if [[ $BACKEND != cuda ]] || has_cuda_torch "$candidate"; then
        BASE=$(command -v "$candidate")
        break
    fi
done
if [[ -z $BASE ]]; then
    log "no python with a CUDA build of torch that sees a GPU; nothing to check"
    exit 2
fi
log "base python: $BASE ($("$BASE" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'))"
if [[ $BACKEND == cuda ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
fi

# 2. A virtualenv over the system packages, with the project in it.
#    A .pth file makes the base python's own site-packages visible too, so this
#    works the same when the base python is itself a virtualenv.
if [[ ! -x $VENV/bin/python ]]; then
    "$BASE" -m venv --system-site-packages "$VENV"
fi
PY=$VENV/bin/python
"$BASE" -c 'import site, sys; print("\n".join(site.getsitepackages()))' \
    >"$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_gpu_check_base.pth"
missing=$("$PY" - <<'EOF'
import importlib.util
need = ["torch", "numpy", "msgspec", "pytest"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [[ -n $missing ]]; then
    if [[ -d $WHEELS ]]; then
        log "installing $missing from $WHEELS (no index)"
        # shellcheck disable=SC2086
        "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" $missing
    else
        log "missing: $missing, and no wheel directory at $WHEELS; cannot run"
        exit 1
    fi
fi
if "$PY" -m pip install --quiet --no-deps --no-index --no-build-isolation -e "$ROOT" >/dev/null 2>&1; then
    log "installed the project into $VENV"
else
    log "pip could not install the project offline; using PYTHONPATH"
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

# 3. The gpu tests. Without pytest-timeout the project's strict pytest config
#    cannot load, so run with the built-in defaults and a shell timeout instead.
PYTEST_ARGS=(-m gpu -q -rs -p no:cacheprovider tests/transfer)
if ! "$PY" -c 'import pytest_timeout' 2>/dev/null; then
    PYTEST_ARGS=(-c /dev/null --rootdir "$ROOT" "${PYTEST_ARGS[@]}")
fi
log "pytest ${PYTEST_ARGS[*]}"
status=0
timeout 300 "$PY" -m pytest "${PYTEST_ARGS[@]}" || status=$?

# 4. The benchmark, one JSON object per line (also saved under $OUT if set).
log "bench/transfer.py --backend $BACKEND --json"
bench_out=${OUT:+$OUT/transfer_bench.jsonl}
timeout 150 "$PY" bench/transfer.py --backend "$BACKEND" --json --total-mib 512 \
    | tee ${bench_out:+"$bench_out"} || status=$?

log "done (exit $status)"
exit "$status"
