"""Which transformers versions the guard claims, and that the ``[transformers]`` extra installs
what each of them needs (no torch or transformers needed here)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvcanary.integrations import transformers as kvt

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["5.20.0", "5.20.2", "5.22.2", "5.24.0", "5.24.1.post1",
                                     "5.23.0+cpu"])
def test_releases_of_the_supported_minors_are_supported(version):
    assert kvt.supported_version(version)


@pytest.mark.parametrize("version", ["5.20.0rc1", "5.20.0.dev0", "5.24.0a1", "5.24.0b2",
                                     "5.25.0.dev0", "5.25.0", "5.19.0", "4.57.6", "6.0.0",
                                     "5", "five.twenty", ""])
def test_pre_releases_and_other_minors_are_not(version):
    assert not kvt.supported_version(version)


def test_the_extra_installs_what_every_supported_version_needs():
    # transformers before 5.24 sizes a CPU host's cache from psutil only: without it the cache
    # gets 0 bytes and generate_batch raises MemoryError.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["transformers"]
    names = {e.split(">")[0].split("=")[0].split("<")[0].strip() for e in extras}
    assert {"torch", "transformers", "psutil"} <= names
    assert f"transformers{kvt.SUPPORTED_RANGE}" in extras


def test_ci_runs_the_integration_tests_on_the_oldest_supported_version_too():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "SUPPORTED_VERSIONS" in ci and "tests/integrations" in ci
    assert f"'transformers{kvt.SUPPORTED_RANGE}'" in ci      # and the newest, for the full run
