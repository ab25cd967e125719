"""The CPU kernel harness keeps its compiled libraries in the user's own cache (or the
directory ``KVCANARY_HARNESS_CACHE`` names), never in a temp folder other users share."""

import tempfile
from pathlib import Path

import kernel_harness


def test_default_cache_is_per_user(monkeypatch, tmp_path):
    monkeypatch.delenv("KVCANARY_HARNESS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_harness.cache_dir() == tmp_path / "xdg" / "kvcanary" / "kernel-harness"
    assert kernel_harness.cache_dir().is_dir()


def test_without_xdg_the_cache_is_under_home_not_the_shared_temp(monkeypatch, tmp_path):
    monkeypatch.delenv("KVCANARY_HARNESS_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = kernel_harness.cache_dir()
    assert path == tmp_path / "home" / ".cache" / "kvcanary" / "kernel-harness"
    assert Path(tempfile.gettempdir()) / "kvcanary-kernel-harness" != path


def test_an_explicit_cache_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCANARY_HARNESS_CACHE", str(tmp_path / "mine"))
    assert kernel_harness.cache_dir() == tmp_path / "mine"
