"""Importing kvcanary imports neither torch nor cupy, and the numpy path works where
importing either fails."""

import subprocess
import sys
import textwrap

BLOCKER = textwrap.dedent("""
    import importlib.abc
    import sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "cupy"):
                raise ImportError(f"blocked import of {name}")
            return None

    sys.meta_path.insert(0, Block())
    for name in list(sys.modules):
        if name.split(".")[0] in ("torch", "cupy"):
            del sys.modules[name]
""")

WORKLOAD = textwrap.dedent("""
    import numpy as np
    import kvcanary as kc

    for banned in ("torch", "cupy"):
        try:
            __import__(banned)
        except ImportError:
            pass
        else:
            raise SystemExit(f"{banned} was importable: the blocker does not work")

    table = (np.arange(2 * 8, dtype=np.int32).reshape(2, 8))
    vp, wp = kc.VerifyPlan.allocate(16), kc.WritePlan.allocate(2)
    log = kc.ViolationLog.allocate(8)
    ctx = kc.CanaryContext(np.zeros((16, 32), np.uint8), kernel_kind=kc.LaunchTag.HEAD_K_FULL,
                           violation_log=log, slot_run_counter=np.zeros(1, np.int64),
                           kernel_run_counter=np.zeros(1, np.int64))
    i64 = lambda v: np.asarray(v, dtype=np.int64)
    kc.plan(req_pool_indices=i64([1]), prefix_lens=i64([0]), extend_seq_lens=i64([4]),
            req_to_token=table, verify_plan=vp, write_plan=wp)
    kc.write(ctx, wp, input_ids=i64([5, 6, 7, 8]), positions=i64([0, 1, 2, 3]),
             out_cache_loc=i64([8, 9, 10, 11]))
    kc.plan(req_pool_indices=i64([1]), prefix_lens=i64([4]), extend_seq_lens=i64([0]),
            req_to_token=table, verify_plan=vp, write_plan=wp)
    kc.verify(ctx, vp)
    assert int(vp.verify_num_valid[0]) == 4
    assert int(log.write_index[0]) == 0
    assert int(ctx.slot_run_counter[0]) == 8
    loaded = sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "cupy"))
    assert loaded == [], loaded
    print("ok")
""")


def run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_numpy_path_works_when_torch_and_cupy_cannot_be_imported():
    result = run(BLOCKER + "import sys\n" + WORKLOAD)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_plain_import_loads_neither():
    result = run("import sys, kvcanary\n"
                 "print(sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'cupy')))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
