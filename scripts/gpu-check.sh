#!/usr/bin/env bash
# GPU check, run from a plain checkout on a machine with a CUDA device, python3 with CuPy,
# numpy, click, pytest and hypothesis, no network and kvcanary not installed:
#   preflight   python, kvcanary and its CLI from this checkout, CuPy, a device (name and
#               compute capability), NVRTC compiling every kernel module; stops in one
#               sentence when something is missing
#   pytest-gpu  the tests marked gpu
#   smoke-n4, smoke-n16   `kvcanary smoke` at two source-count bounds
#   bench-gpu   benchmarks/bench_gpu.py, its JSON written as each figure arrives
# Logs and results go under $OUT when set (else a fresh temp directory), CuPy's kernel cache
# too. Every step has its own time limit; together they stay under 6 minutes. The exit
# status is the first failure (3 when the preflight stops).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="${OUT:-$(mktemp -d -t kvcanary-gpu-check.XXXXXX)}"
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export CUPY_CACHE_DIR="$RESULTS/cupy-cache"

# kvcanary from this checkout, laid out the way an install lays it out: the package with
# its kernel sources (kernels/) inside it. Links only; nothing is copied.
SITE="$RESULTS/site"
rm -rf "$SITE" && mkdir -p "$SITE/kvcanary"
for entry in "$ROOT"/kvcanary/*; do
  case "$(basename "$entry")" in __pycache__) continue ;; esac
  ln -s "$entry" "$SITE/kvcanary/"
done
ln -s "$ROOT/kernels" "$SITE/kvcanary/kernels"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# Outside the checkout, so that `python -m` and `-c` (which put the working directory
# first on sys.path) import the linked package, not the checkout's bare kvcanary/.
cd "$RESULTS"

: >"$RESULTS/summary.txt"
status=0

step() {  # step NAME SECONDS COMMAND...
  local name="$1" limit="$2"
  shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)" | tee -a "$RESULTS/summary.txt"
  timeout --kill-after=5 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - start))s" | tee -a "$RESULTS/summary.txt"
  tail -n 15 "$RESULTS/$name.log"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu-check: stopped: no $PY on PATH (set PYTHON to the interpreter to use)." \
    | tee -a "$RESULTS/summary.txt"
  exit 3
fi

# One sentence on stdout and exit 3 when something is missing; the environment otherwise.
timeout 60 "$PY" - "$ROOT" >"$RESULTS/preflight.txt" 2>"$RESULTS/preflight.err" <<'PY'
import importlib
import importlib.util
import platform
import subprocess
import sys

ROOT = sys.argv[1]


def stop(sentence):
    print(f"gpu-check: stopped: {sentence}")
    sys.exit(3)


for name in ("numpy", "click", "pytest", "hypothesis", "kvcanary", "kvcanary.cli",
             "kvcanary.backends.cuda.launch"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure is reported as one sentence
        stop(f"python {platform.python_version()} cannot import {name} ({type(exc).__name__}: "
             f"{exc}).")
import kvcanary  # noqa: E402

spec = importlib.util.spec_from_file_location("bench_gpu", f"{ROOT}/benchmarks/bench_gpu.py")
try:
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
except Exception as exc:  # noqa: BLE001
    stop(f"benchmarks/bench_gpu.py does not import ({type(exc).__name__}: {exc}).")
collect = subprocess.run(
    [sys.executable, "-m", "pytest", f"{ROOT}/tests", "--rootdir", ROOT, "-c",
     f"{ROOT}/pyproject.toml", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
    capture_output=True, text=True)
if collect.returncode != 0:
    errors = [line for line in collect.stdout.splitlines() if "Error" in line] or ["no detail"]
    stop(f"pytest cannot collect the GPU tests from this checkout ({errors[0].strip()}).")

try:
    import cupy
except Exception as exc:  # noqa: BLE001
    stop(f"CuPy is not importable ({type(exc).__name__}: {exc}); the GPU check needs CuPy.")
print("python", platform.python_version(), "numpy", sys.modules["numpy"].__version__,
      "cupy", cupy.__version__, "kvcanary", kvcanary.__version__)
try:
    count = cupy.cuda.runtime.getDeviceCount()
except Exception as exc:  # noqa: BLE001
    stop(f"no CUDA device: CuPy cannot reach a driver ({str(exc).splitlines()[0]}).")
if count < 1:
    stop("no CUDA device: CuPy sees none.")
props = cupy.cuda.runtime.getDeviceProperties(0)
name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
print(f"devices {count}; device 0: {name}, compute capability {props['major']}.{props['minor']}, "
      f"{props['multiProcessorCount']} SMs")
try:
    print("nvrtc", cupy.cuda.nvrtc.getVersion())
except Exception as exc:  # noqa: BLE001
    stop(f"CuPy finds no NVRTC ({type(exc).__name__}: {str(exc).splitlines()[0]}).")
from kvcanary.backends.cuda import launch  # noqa: E402

for kernel, names in launch.KERNEL_FILES.items():
    for entry in names:
        try:
            launch.kernel_function(kernel, None if kernel == "plan" else 4, False, entry).kernel
        except Exception as exc:  # noqa: BLE001
            stop(f"NVRTC could not compile kernels/{launch.KERNEL_FILES[kernel][0]} for {name}, "
                 f"or CuPy could not load it ({type(exc).__name__}: "
                 f"{str(exc).splitlines()[0]}); are CUDA's headers where CuPy looks?")
print("kernels compiled:", ", ".join(n for names in launch.KERNEL_FILES.values() for n in names))
PY
preflight=$?
cat "$RESULTS/preflight.txt"
if [ "$preflight" -ne 0 ]; then
  if ! grep -q "^gpu-check: stopped:" "$RESULTS/preflight.txt"; then
    echo "gpu-check: stopped: the preflight failed (exit $preflight); see $RESULTS/preflight.err."
  fi
  tee -a "$RESULTS/summary.txt" <"$RESULTS/preflight.txt" >/dev/null
  exit 3
fi

step pytest-gpu 150 "$PY" -m pytest "$ROOT/tests" --rootdir "$ROOT" -c "$ROOT/pyproject.toml" \
  -m gpu -q -rs -p no:cacheprovider --durations=10 --junitxml="$RESULTS/pytest-gpu.xml"
KVCANARY=("$PY" -c 'from kvcanary.cli import main; main(prog_name="kvcanary")')
step smoke-n4 25 "${KVCANARY[@]}" smoke --max-real-kv-sources 4
step smoke-n16 25 "${KVCANARY[@]}" smoke --max-real-kv-sources 16
step bench-gpu 70 "$PY" "$ROOT/benchmarks/bench_gpu.py" --json "$RESULTS/bench_gpu.json"

echo "gpu-check: exit $status (logs in $RESULTS)" | tee -a "$RESULTS/summary.txt"
exit "$status"
