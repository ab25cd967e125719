"""Exit codes of ``kvcanary audit`` over several dumps: a bad dump (exit 2) outranks a dump
with violations (exit 1), which outranks clean ones (exit 0), whatever the order of the
dumps on the command line; and a dump the loader must refuse is a bad dump."""

import itertools
import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvcanary.cli import main
from kvcanary.dump import DUMP_VERSION, VERSION_KEY, DumpError, load
from test_request_boundaries import clean_batch_arrays


def savez(path, arrays):
    """Write the arrays as they are (``dump.save`` may refuse what the loader must refuse)."""
    np.savez(path, **{VERSION_KEY: np.int64(DUMP_VERSION)}, **arrays)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dumps")
    clean = clean_batch_arrays()
    faulty = clean_batch_arrays()
    faulty["canary"].view("<i8")[12, 1] = 9  # a stored position
    bad = dict(clean_batch_arrays(), seq_lens=np.array([1, 2], np.int64))  # wrong length
    paths = {}
    for name, arrays in (("clean", clean), ("faulty", faulty), ("bad", bad)):
        paths[name] = str(folder / f"{name}.npz")
        savez(paths[name], arrays)
    return paths


CODE = {"clean": 0, "faulty": 1, "bad": 2}


@pytest.mark.parametrize("names", [
    *itertools.permutations(["clean", "faulty", "bad"], 2),
    ("clean", "faulty", "bad"), ("bad", "faulty", "clean"), ("faulty", "bad", "faulty"),
    ("clean",), ("faulty",), ("bad",)])
def test_the_worst_dump_decides_the_exit_code_in_any_order(dumps, names, jobs="1"):
    result = CliRunner().invoke(main, ["audit", "--jobs", jobs, *(dumps[n] for n in names)])
    assert result.exit_code == max(CODE[n] for n in names), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    if "bad" in names:
        assert "key seq_lens" in result.output


@pytest.mark.parametrize("names", [("bad", "faulty"), ("faulty", "bad")])
def test_the_worst_dump_decides_with_parallel_audits(dumps, names):
    test_the_worst_dump_decides_the_exit_code_in_any_order(dumps, names, jobs="2")


def test_negative_expected_tokens_valid_lens_is_refused_at_load(tmp_path):
    """Accepted, a negative length would silently turn the token check off for that row."""
    arrays = clean_batch_arrays()
    arrays.update(expected_tokens=np.zeros((6, 8), np.int32),
                  expected_tokens_valid_lens=np.array([4, 5, 0, 0, 3, -1], np.int64))
    path = str(tmp_path / "d.npz")
    savez(path, arrays)
    with pytest.raises(DumpError, match=r"key expected_tokens_valid_lens: holds a negative "
                                        r"value \(-1\)"):
        load(path)
    result = CliRunner().invoke(main, ["audit", path])
    assert result.exit_code == 2 and "expected_tokens_valid_lens" in result.output
    arrays["expected_tokens_valid_lens"][-1] = 0  # control: the same dump with 0 loads
    savez(path, arrays)
    assert load(path).expected_tokens_valid_lens.tolist() == [4, 5, 0, 0, 3, 0]


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_each_dump_is_rendered_in_the_chosen_format(dumps, fmt):
    """JSON Lines: a config, violation... and summary record per audited dump and an error
    record per bad dump; text: no JSON at all."""
    result = CliRunner().invoke(main, ["audit", "--jobs", "1", "--format", fmt,
                                       dumps["bad"], dumps["faulty"]])
    assert result.exit_code == 2
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if fmt == "text":
        assert lines == []
        return
    records = [json.loads(line)["record"] for line in lines]
    assert records[0] == "error" and records[1] == "config"
    assert "violation" in records and "summary" in records
