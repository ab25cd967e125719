#!/usr/bin/env bash
# GPU check for a machine with a CUDA device, the CUDA 13 build of CuPy and no network:
# the GPU tests, `kvcanary smoke` at two source-count bounds, and the GPU benchmarks.
# Logs and results go under $OUT when set (else a fresh temp directory). Every step has its own
# time limit so the whole run stays under 8 minutes; the exit status is the first failure.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$(mktemp -d -t kvcanary-gpu-check.XXXXXX)}"
mkdir -p "$RESULTS"
if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3)"; fi
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS COMMAND...
  local name="$1" limit="$2"
  shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)" | tee -a "$RESULTS/summary.txt"
  timeout --kill-after=10 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - start))s" | tee -a "$RESULTS/summary.txt"
  tail -n 15 "$RESULTS/$name.log"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

: >"$RESULTS/summary.txt"
"$PY" - <<'PY' >"$RESULTS/environment.txt" 2>&1
import platform, cupy, kvcanary
print("python", platform.python_version(), "cupy", cupy.__version__, "kvcanary", kvcanary.__version__)
print("devices", cupy.cuda.runtime.getDeviceCount())
p = cupy.cuda.runtime.getDeviceProperties(0)
print("device 0", p["name"], "cc", p["major"], p["minor"], "SMs", p["multiProcessorCount"])
PY
cat "$RESULTS/environment.txt"

step pytest-gpu 230 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
  --junitxml="$RESULTS/pytest-gpu.xml" tests
KVCANARY=("$PY" -c 'from kvcanary.cli import main; main(prog_name="kvcanary")')
step smoke-n4 45 "${KVCANARY[@]}" smoke --max-real-kv-sources 4
step smoke-n16 45 "${KVCANARY[@]}" smoke --max-real-kv-sources 16
step bench-gpu 120 "$PY" benchmarks/bench_gpu.py --json "$RESULTS/bench_gpu.json"

echo "gpu-check: exit $status (logs in $RESULTS)" | tee -a "$RESULTS/summary.txt"
exit "$status"
