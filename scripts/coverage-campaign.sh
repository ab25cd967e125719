#!/usr/bin/env bash
# The detection-coverage campaign behind docs/coverage.md: at least 1,000 faults of every kind
# at every target class in every real-KV hash mode, 200 clean runs, seed 0, every CPU core; markdown on stdout (or in
# the file given as the first argument). Extra arguments go to `kvcanary campaign`, e.g.
#   scripts/coverage-campaign.sh /tmp/coverage.md --backend numpy
# Exit status: 0 every target met, 1 a target missed (each miss names the commands that
# reproduce it), 2 bad input.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -x "$ROOT/.venv/bin/kvcanary" ]; then KVC="$ROOT/.venv/bin/kvcanary"; else KVC="kvcanary"; fi
OUT_FILE="${1:-}"
[ $# -gt 0 ] && shift

start=$SECONDS
if [ -n "$OUT_FILE" ]; then
  "$KVC" campaign --faults-per-kind 1000 --clean-runs 200 --seed 0 --format markdown \
    --out "$OUT_FILE" "$@"
else
  "$KVC" campaign --faults-per-kind 1000 --clean-runs 200 --seed 0 --format markdown "$@"
fi
status=$?
echo "coverage campaign: exit $status after $((SECONDS - start))s" >&2
exit $status
