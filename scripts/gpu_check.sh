#!/usr/bin/env bash
# GPU check of the data plane, made to run at the first try on a lent GPU
# machine (15 minutes, no network): the transfer tests (the contract suite
# over every backend, cuda included, and the cuda backend's own tests), then
# store and load bandwidth of the cuda backend, pinned and pageable, at 16 KiB,
# 256 KiB and 2 MiB pages. Everything goes to stderr but the last thing: ONE
# JSON line on stdout with the figures that matter. Budget: under 8 minutes.
#
# It changes nothing on the machine. It uses the python whose torch sees the
# GPU ($PYTHON, else python3) as it is; a distribution that python lacks
# (the device image has no msgspec) is unpacked from a wheel that travels with
# the working tree ($GPU_CHECK_WHEELS, default ./wheels, filled here by
# `make gpu-wheels`) into a scratch folder on PYTHONPATH, never fetched from an
# index. The project itself is used from the working tree (PYTHONPATH).
#
#   scripts/gpu_check.sh                          # exit 2 when no torch sees a GPU
#   GPU_CHECK_BACKEND=cpu scripts/gpu_check.sh    # dry run of the script itself
#
# Exit status: 0 when every test passed and both benchmark runs finished, 1
# otherwise, 2 without a usable python. Knobs: GPU_CHECK_TOTAL_MIB (bytes per
# job, default 512; 16 for cpu), GPU_CHECK_REPEAT (5; 1 for cpu),
# GPU_CHECK_BUDGET_S (450: steps are cut to what is left of it), OUT (a folder
# that gets the logs, the junit report, the benchmark rows and the summary).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
BACKEND=${GPU_CHECK_BACKEND:-cuda}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/wheels}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
if [[ $BACKEND == cuda ]]; then TOTAL_MIB=512 REPEAT=5; else TOTAL_MIB=16 REPEAT=1; fi
TOTAL_MIB=${GPU_CHECK_TOTAL_MIB:-$TOTAL_MIB}
REPEAT=${GPU_CHECK_REPEAT:-$REPEAT}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tiering-gpu-check.XXXXXX")
DEPS=$WORK/site
OUT=${OUT:-}
#: Distributions the run imports (the project's runtime, the tests' runner);
#: `make gpu-wheels` downloads those the device image lacks (GPU_WHEELS there).
NEED=${GPU_CHECK_NEED:-"torch numpy msgspec pytest"}
START=$(date +%s)

log() { printf '[gpu_check %3ss] %s\n' "$(($(date +%s) - START))" "$*" >&2; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
# step LIMIT CMD...: CMD under a timeout of LIMIT seconds, or what is left of the budget.
step() {
    local limit=$1 rest
    shift
    rest=$(left)
    ((rest < limit)) && limit=$rest
    if ((limit < 5)); then
        log "out of time for: $*"
        return 124
    fi
    timeout --kill-after=10 "$limit" "$@"
}
save() { [[ -n $OUT ]] && mkdir -p "$OUT" && cp "$@" "$OUT/" 2>/dev/null; return 0; }
# give_up STATUS REASON: the summary line of a check that could not run, then exit.
give_up() {
    log "$2"
    printf '{"gpu_check":"failed","backend":"%s","reason":"%s","seconds":%d}\n' \
        "$BACKEND" "${2//\"/\'}" "$(($(date +%s) - START))"
    exit "$1"
}

# 1. A python whose torch sees the GPU (for the dry run: any torch).
if [[ $BACKEND == cuda ]]; then
    probe='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
else
    probe='import torch'
fi
BASE=""
for candidate in "${PYTHON:-}" python3 /opt/torch/.venv/bin/python3 "$ROOT/.venv/bin/python" python; do
    [[ -n $candidate ]] && command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c "$probe" >/dev/null 2>&1; then
        BASE=$(command -v "$candidate")
        break
    fi
done
if [[ -z $BASE ]]; then
    give_up 2 "no python whose torch sees a GPU (tried \$PYTHON, python3, /opt/torch/.venv/bin/python3, .venv, python)"
fi
log "python: $BASE ($("$BASE" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'))"
if [[ $BACKEND == cuda ]] && command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
fi

# 2. What the python lacks, unpacked from the wheels that came along.
export PYTHONPATH=$ROOT:$DEPS${PYTHONPATH:+:$PYTHONPATH}
# shellcheck disable=SC2086
"$BASE" - "$WHEELS" "$DEPS" $NEED <<'EOF' >"$WORK/deps.log" 2>&1
"""Unpack, from wheel files, each needed distribution this python lacks (and what it needs)."""
import importlib.metadata as md
import os
import re
import sys
import sysconfig
import zipfile

wheels, target, need = sys.argv[1], sys.argv[2], sys.argv[3:]
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()  # noqa: E731
py = f"{sys.version_info.major}{sys.version_info.minor}"
arch = sysconfig.get_platform().split("-")[-1]  # x86_64, aarch64


def fits(filename: str) -> bool:
    parts = filename[: -len(".whl")].split("-")
    pys, abis, plats = (set(p.split(".")) for p in parts[-3:])
    return (
        bool(pys & {f"cp{py}", f"py{py}", "py3"})
        and bool(abis & {f"cp{py}", "abi3", "none"})
        and any(p == "any" or (p.endswith(arch) and "linux" in p) for p in plats)
    )


found = {}
if os.path.isdir(wheels):
    for f in sorted(os.listdir(wheels)):
        if f.endswith(".whl") and fits(f):
            found[norm(f.split("-")[0])] = os.path.join(wheels, f)  # one per distribution


def present(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


todo, done, missing = list(need), set(), []
while todo:
    name = todo.pop()
    if norm(name) in done or present(name):
        continue
    done.add(norm(name))
    wheel = found.get(norm(name))
    if wheel is None:
        missing.append(name)
        continue
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    print(f"unpacked {os.path.basename(wheel)}")
    for line in text.splitlines():  # what it needs, unless only for an extra
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            todo.append(re.split(r"[\s;<>=!~\[(]", line.split(":", 1)[1].strip())[0])
if missing:
    print(
        f"missing: {' '.join(missing)}, with no wheel for Python {py} {arch} in {wheels}; "
        "on a machine with the network, run `make gpu-wheels`, then carry wheels/"
    )
    sys.exit(1)
EOF
status=$?
cat "$WORK/deps.log" >&2
((status == 0)) || give_up 2 "$(tail -1 "$WORK/deps.log")"

# 3. The transfer tests: the contract over every backend, the cuda backend's own.
#    Without pytest-timeout the project's strict config cannot load: use none.
PYTEST_ARGS=(-q -rfEs -p no:cacheprovider --junitxml "$WORK/junit.xml" tests/transfer)
if ! "$BASE" -c 'import pytest_timeout' 2>/dev/null; then
    PYTEST_ARGS=(-c /dev/null --rootdir "$ROOT" "${PYTEST_ARGS[@]}")
fi
log "pytest ${PYTEST_ARGS[*]}"
step 240 "$BASE" -m pytest "${PYTEST_ARGS[@]}" 2>&1 | tee "$WORK/pytest.log" >&2
TESTS_STATUS=${PIPESTATUS[0]}
save "$WORK/pytest.log" "$WORK/junit.xml"

# 4. Bandwidth, pinned then pageable (the pageable fallback must work too).
BENCH_STATUS=0
for mode in pinned pageable; do
    args=(--backend "$BACKEND" --json --total-mib "$TOTAL_MIB" --repeat "$REPEAT")
    if [[ $mode == pinned ]]; then args+=(--chunk-order all); else args+=(--chunk-order sequential --no-pin); fi
    log "bench/transfer.py ${args[*]}"
    step 90 "$BASE" bench/transfer.py "${args[@]}" >"$WORK/bench_$mode.jsonl"
    status=$?
    ((status != 0)) && BENCH_STATUS=$status && log "bench ($mode) exited $status"
    cat "$WORK/bench_$mode.jsonl" >&2
    save "$WORK/bench_$mode.jsonl"
done

# 5. The summary: one JSON line on stdout.
"$BASE" - "$WORK" "$BACKEND" "$TESTS_STATUS" "$BENCH_STATUS" "$(($(date +%s) - START))" \
    >"$WORK/summary.json" <<'EOF'
import json
import platform
import re
import sys
import xml.etree.ElementTree as ET

work, backend, tests_status, bench_status, seconds = sys.argv[1:]
summary = {"gpu_check": "failed", "backend": backend, "python": platform.python_version()}
try:
    import torch

    summary["torch"] = torch.__version__
    summary["cuda"] = torch.version.cuda
    if backend == "cuda":
        summary["device"] = torch.cuda.get_device_name(0)
except Exception as exc:  # the summary is printed whatever happened
    summary["torch"] = f"{type(exc).__name__}: {exc}"

counts = {"passed": 0, "failed": 0, "skipped": 0}
contract = dict(counts)
failures = []
try:
    for case in ET.parse(f"{work}/junit.xml").iter("testcase"):
        if case.find("skipped") is not None:
            outcome = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            message = (bad.get("message") or "").splitlines()
            failures.append(f"{case.get('name')}: {message[0][:160] if message else ''}")
        else:
            outcome = "passed"
        counts[outcome] += 1
        name = case.get("name", "")
        if "test_transfer_contract" in case.get("classname", "") and re.search(
            rf"[\[-]{backend}[\]-]", name
        ):
            contract[outcome] += 1
except (OSError, ET.ParseError) as exc:
    failures.append(f"no junit report: {exc}")
summary["tests"] = counts
summary["contract"] = contract  # the contract suite over this backend
summary["failures"] = failures[:10]

gbps, limit, shuffled, pinned = {}, {}, {}, {}
for mode in ("pinned", "pageable"):
    try:
        with open(f"{work}/bench_{mode}.jsonl") as f:
            rows = [json.loads(line) for line in f if line.startswith("{")]
    except (OSError, ValueError):
        rows = []
    for row in rows:
        page = row["page_bytes"]
        key = f"{page >> 20}MiB" if page >= 1 << 20 else f"{page >> 10}KiB"
        table = gbps if row["chunk_order"] == "sequential" else shuffled
        table.setdefault(mode, {}).setdefault(row["direction"], {})[key] = row["gbps"]
        if row["chunk_order"] == "sequential":
            limit.setdefault(mode, {}).setdefault(row["direction"], {})[key] = row["limit_gbps"]
        pinned[mode] = row.get("pinned")
summary["gbps"] = gbps  # job GB/s, chunk ids in order (fresh slots)
summary["limit_gbps"] = limit  # one contiguous copy of the same bytes
summary["shuffled_gbps"] = shuffled  # chunk ids shuffled (the worst case), pinned only
summary["pool_pinned"] = pinned  # whether the backend really pinned the pool (cuda)
ok = tests_status == "0" and bench_status == "0" and counts["failed"] == 0
ok = ok and contract["passed"] > 0 and contract["failed"] == 0
ok = ok and all(len(gbps.get(m, {}).get(d, {})) == 3 for m in gbps for d in ("store", "load"))
ok = ok and set(gbps) == {"pinned", "pageable"}
# On a GPU the "pinned" rows are pinned only if the backend really pinned its pool
# (a failed cudaHostRegister is logged, and the copies run pageable).
ok = ok and (backend != "cuda" or pinned.get("pinned") is True)
summary["gpu_check"] = "ok" if ok else "failed"
summary["exit"] = {"tests": int(tests_status), "bench": int(bench_status)}
summary["seconds"] = int(seconds)
print(json.dumps(summary, separators=(",", ":")))
EOF
save "$WORK/summary.json"
log "done; logs in $WORK${OUT:+ and $OUT}"
cat "$WORK/summary.json"
grep -q '"gpu_check":"ok"' "$WORK/summary.json"
