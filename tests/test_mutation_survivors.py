"""Behaviours the mutation run (scripts/mutation.py) found unpinned: each test here kills
mutants that survived the rest of the suite."""

import pytest

from kvcanary.hashing import to_signed, to_unsigned


@pytest.mark.parametrize("bits, value", [
    (0, 0), ((1 << 63) - 1, (1 << 63) - 1), (1 << 63, -(1 << 63)), ((1 << 64) - 1, -1),
    (1 << 64, 0), (-1, -1)])
def test_to_signed_at_the_int64_edges(bits, value):
    assert to_signed(bits) == value
    assert to_unsigned(value) == bits & ((1 << 64) - 1)
