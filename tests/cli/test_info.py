"""``kvcanary info`` says where NVRTC (which compiles the kernels) comes from: the library
CuPy's lookup loads, how it was found and the pip wheel behind it, or why there is none."""

import sys
import types
from collections import namedtuple


from kvcanary.tools import info

LoadedDL = namedtuple("LoadedDL", "abs_path found_via")


def fake_pathfinder(monkeypatch, load):
    pathfinder = types.SimpleNamespace(load_nvidia_dynamic_lib=load)
    monkeypatch.setitem(sys.modules, "cuda", types.SimpleNamespace(pathfinder=pathfinder))
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", pathfinder)


def test_a_pip_nvrtc_is_reported_with_its_path_and_wheel(monkeypatch):
    path = "/venv/site-packages/nvidia/cu13/lib/libnvrtc.so.13"
    fake_pathfinder(monkeypatch, lambda name: LoadedDL(path, "site-packages"))
    monkeypatch.setattr(info, "_package_version",
                        lambda name: "13.0.88" if name == "nvidia-cuda-nvrtc" else "not installed")
    report = info.environment_report()["nvrtc"]
    assert report == f"{path} (found via site-packages, pip nvidia-cuda-nvrtc 13.0.88)"


def test_a_system_nvrtc_names_no_wheel(monkeypatch):
    path = "/usr/local/cuda/lib64/libnvrtc.so.12"
    fake_pathfinder(monkeypatch, lambda name: LoadedDL(path, "CUDA_PATH"))
    monkeypatch.setattr(info, "_package_version", lambda name: "12.9.86")
    assert info.environment_report()["nvrtc"] == f"{path} (found via CUDA_PATH)"


def test_a_missing_nvrtc_says_why_and_which_extra_brings_it(monkeypatch):
    def load(name):
        raise FileNotFoundError(f"Failure finding lib{name}.so")

    fake_pathfinder(monkeypatch, load)
    report = info.environment_report()["nvrtc"]
    assert report.startswith("not found (FileNotFoundError: Failure finding libnvrtc.so")
    assert "kvcanary[cuda13]" in report


def test_without_cuda_pathfinder_info_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)
    report = info.environment_report()["nvrtc"]
    assert report.startswith("not found (cuda-pathfinder") and "kvcanary[cuda13]" in report
