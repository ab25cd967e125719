#!/usr/bin/env bash
# Install the oldest CuPy that each CUDA extra of pyproject.toml allows (cuda12, cuda13),
# each with its own numpy, into its own directory under DEST (default .ci-cupy). Prints
# the directories joined by ':', the value tests/kernels/test_cuda_host_side.py reads from
# KVCANARY_CUPY_PATHS. Needs a package index, no GPU (CuPy imports without one).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.ci-cupy}"
PY="${PYTHON:-python3}"
paths=()
while read -r requirement; do
  target="$DEST/${requirement/==/-}"
  if [ ! -d "$target/cupy" ]; then
    "$PY" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts \
      --target "$target" "$requirement" >&2
  fi
  paths+=("$(cd "$target" && pwd)")
done < <("$PY" - <<'PY'
import re
text = open("pyproject.toml", encoding="utf-8").read()
for name, floor in re.findall(r'"(cupy-cuda\d+x)>=([0-9.]+)"', text):
    print(f"{name}=={floor}")
PY
)
(IFS=:; echo "${paths[*]}")
