"""What the package declares matches what it ships: the license file, and CUDA extras that
bring everything compiling the kernels needs."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_declared_license_ships_as_its_full_text():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert len(text.splitlines()) > 150  # the full terms, not a pointer to them


@pytest.mark.parametrize("major", ["12", "13"])
def test_each_cuda_extra_brings_nvrtc_and_the_runtime_of_its_cuda(major):
    # CuPy 14 and later find pip's CUDA libraries (earlier ones only the system's), and
    # compiling a RawModule needs NVRTC and the CUDA runtime's headers and library.
    extra = PYPROJECT["project"]["optional-dependencies"][f"cuda{major}"]
    cupy = [r for r in extra if r.startswith(f"cupy-cuda{major}x")]
    assert cupy == [f"cupy-cuda{major}x>=14"]
    toolkit = [r for r in extra if r.startswith("cuda-toolkit[")]
    assert len(toolkit) == 1 and toolkit[0].endswith(f"]=={major}.*"), extra
    components = set(toolkit[0][len("cuda-toolkit["):toolkit[0].index("]")].split(","))
    assert {"nvrtc", "cudart"} <= components


def test_the_test_extra_brings_one_array_framework_and_the_nvrtc_check():
    # torch's CPU build (.ci/run) is the DLPack producer; the extra brings no second one.
    test = " ".join(PYPROJECT["project"]["optional-dependencies"]["test"])
    assert "jax" not in test and "torch" not in test
    for needed in ("pytest", "hypothesis", "cuda-core", "nvidia-cuda-nvrtc", "cuda-bindings"):
        assert needed in test
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ci.index("pip install --quiet 'torch==2.13.0+cpu'") < ci.index("python -m pytest")


def test_every_subpackage_is_listed_for_the_wheel():
    # The package list is explicit (the kernels map from a folder outside the package), so a
    # new subpackage missing from it would be absent from an installed kvcanary.
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "kvcanary").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
    assert "kvcanary.kernels" in listed
