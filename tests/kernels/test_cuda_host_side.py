"""The CUDA backend's host side on real CuPy, without a GPU (tests/cupy_stub.py says how):

* conversion      CuPy's own kernel-argument conversion accepts every launch's argument
                  list, made by the public API; no launch allocates device memory,
                  synchronises or copies to the host on the way
* mixed_devices   arrays on two GPUs are one clear error naming the array
* function_cache  kernel functions are looked up once, not on every launch
* aliasing        an argument over another's device memory is refused, naming both

Each runs on the CuPy installed here, if any, and in a subprocess on each CuPy of
``KVCANARY_CUPY_PATHS`` (``pip install --target`` directories joined by ``os.pathsep``):
.ci/run fills it with the oldest CuPy each CUDA extra allows (scripts/install-oldest-cupy.sh),
and then the floors of pyproject.toml must be among them."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]     # tests/, where cupy_stub.py lives
ROOT = HERE.parent
NOT_SET = ("KVCANARY_CUPY_PATHS is not set (.ci/run sets it to the oldest CuPy of each extra, "
           "installed by scripts/install-oldest-cupy.sh)")


def cupy_paths() -> list[str]:
    return [p for p in os.environ.get("KVCANARY_CUPY_PATHS", "").split(os.pathsep) if p]


CHECKS = ("conversion", "mixed_devices", "function_cache", "repeat_launch", "aliasing")


def assert_passed(cupy_version: str, check: str, cases: dict) -> None:
    failed = {case: outcome for case, outcome in cases.items() if outcome != "ok"}
    assert cases and not failed, f"{check} on CuPy {cupy_version}: {failed}"


@pytest.mark.needs_cupy
@pytest.mark.parametrize("check", CHECKS)
def test_on_the_installed_cupy(check):
    import cupy
    import cupy_stub

    assert_passed(cupy.__version__, check, cupy_stub.run_checks(cupy)[check])


@functools.lru_cache(maxsize=None)
def checks_under(path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, str(ROOT)]))
    done = subprocess.run([sys.executable, str(HERE / "cupy_stub.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("path", cupy_paths() or [
    pytest.param(None, marks=pytest.mark.skip(reason=NOT_SET))])
def test_on_listed_cupy(path, check):
    payload = checks_under(path)
    cases = payload["results"][check]
    print(f"{check}: CuPy {payload['cupy']} (numpy {payload['numpy']}), {len(cases)} cases")
    assert_passed(payload["cupy"], check, cases)


def extra_floors() -> dict[str, str]:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    return dict(re.findall(r'"(cupy-cuda\d+x)>=([0-9.]+)"', text))


def installed_cupy(path: str) -> tuple[str, str] | None:
    for entry in Path(path).glob("cupy_cuda*.dist-info"):
        name, version = entry.name.removesuffix(".dist-info").split("-")
        return name.replace("_", "-"), version
    return None


def test_listed_cupy_include_every_extra_floor():
    if not cupy_paths():
        pytest.skip(NOT_SET)
    installed = {installed_cupy(p) for p in cupy_paths()}
    floors = extra_floors()
    assert set(floors) == {"cupy-cuda12x", "cupy-cuda13x"}
    for name, floor in floors.items():
        padded = ".".join((floor.split(".") + ["0", "0"])[:3])
        assert (name, padded) in installed, f"{name}=={padded} not among {sorted(installed)}"
