"""The shared-slot audit benchmark still runs (tiny sizes), so it cannot rot: both layouts of
entries (live, sweep) are audited on one slot and on distinct slots, with the ratio printed."""

import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_audit_shared_slot.py"


def test_bench_audit_shared_slot_quick():
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = re.findall(r"^(live|sweep)\s+1024 entries: .* ratio ([\d.]+)x", result.stdout, re.M)
    assert [kind for kind, _ in lines] == ["live", "sweep"], result.stdout
