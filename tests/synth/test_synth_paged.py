"""Paged layouts end to end: ``synth --block-size`` simulates a paged engine (block allocator
with reuse, prefix cache sharing full blocks) and dumps a block table; the dump keys load in
every container; audit of a paged dump reports exactly what it reports for the equivalent
per-token dump, attributed to row, position and block; every paged fault form is detected."""

from __future__ import annotations

import numpy as np
import pytest

import skip_reasons
from click.testing import CliRunner

from kvcanary.audit import audit
from kvcanary.cli.main import main
from kvcanary.dump import DumpError, load, save
from kvcanary.synth import (
    EXPECTED_BITS,
    FAULT_KINDS,
    PAGED_FAULT_KINDS,
    SynthConfig,
    SynthError,
    Synthesis,
    faults_from_dump,
    score,
)
from synth_support import SMALL, roundtrip, run


def per_token_arrays(arrays: dict) -> dict:
    """The same dump with the block table written out as ``req_to_token`` (Python loops,
    independent of the library's lookup)."""
    table, size = arrays["block_table"], int(arrays["block_size"])
    flat = np.zeros((table.shape[0], table.shape[1] * size), dtype=np.int64)
    for row in range(table.shape[0]):
        for position in range(flat.shape[1]):
            block = int(table[row, position // size])
            flat[row, position] = 0 if block == 0 else block * size + position % size
    out = {k: v for k, v in arrays.items() if k not in ("block_table", "block_size")}
    out["req_to_token"] = flat
    return out


@pytest.mark.parametrize("block_size, swa, sources, mode", [
    (1, 0, 1, "all"), (4, 0, 2, "partial"), (16, 0, 0, "none"), (4, 24, 3, "all"),
    (16, 40, 1, "partial")])
def test_clean_paged_workloads_audit_clean(tmp_path, block_size, swa, sources, mode):
    num_slots = 2048 if block_size == 16 else 1024
    synthesis = run(block_size=block_size, swa_window=swa, sources=sources, mode=mode,
                    num_slots=num_slots, seed=7)
    arrays = synthesis.arrays()
    assert "req_to_token" not in arrays and arrays["block_table"].dtype == np.int32
    d = roundtrip(tmp_path, synthesis)
    assert d.req_to_token is None and d.block_size == block_size
    assert d.block_table.shape == (SMALL["max_running"] + 1,
                                   -(-synthesis.config.max_context_len // block_size))
    result = audit(d, backend="numpy")
    assert result.total_violations == 0 and result.live_entries > 0 and result.sweep_entries > 0


def test_paged_engine_allocates_shares_and_reuses_blocks():
    s = run(block_size=4, num_slots=512, requests=40, seed=3)
    assert s.stats.cached_tokens_reused > 0 and s.stats.slots_reused > 0
    assert s.stats.blocks_evicted > 0
    rows, seq_lens = s.live()
    for row, length in zip(rows, seq_lens):
        blocks = s.table[row, :-(-int(length) // 4)]
        assert (blocks != 0).all()                       # the null block is never handed out
    shared = [r for r in s.running if r.matched > 0]
    assert shared
    for r in shared:                                     # matched prefix: the cache's blocks
        cached = np.concatenate([b.slots for b in r.blocks])
        np.testing.assert_array_equal(s.table[r.row, :r.matched // 4], cached[::4] // 4)
    # A cached block two live requests share appears in both block tables.
    counts = {}
    for r in s.running:
        for b in r.blocks:
            counts[id(b)] = counts.get(id(b), 0) + 1
    assert all(b.refs >= counts.get(id(b), 0) for b in s.cache.values())


@pytest.mark.parametrize("options", [dict(block_size=4), dict(block_size=16, num_slots=2048),
                                     dict(block_size=4, swa_window=24, sources=3)],
                         ids=["b4", "b16", "b4-swa"])
def test_paged_audit_equals_the_per_token_audit(tmp_path, options):
    synthesis = run(seed=5, requests=40, **options)
    for kind in FAULT_KINDS:
        try:
            synthesis.inject(kind)
        except SynthError:      # a small live set runs out of whole blocks to claim
            pass
    assert len(synthesis.faults) >= 6
    arrays = synthesis.arrays()
    paged = audit(load(save(str(tmp_path / "paged.npz"), **arrays)), backend="numpy")
    flat = audit(load(save(str(tmp_path / "flat.npz"), **per_token_arrays(arrays))),
                 backend="numpy")
    assert paged.total_violations == flat.total_violations > 0
    assert paged.counts_by_reason == flat.counts_by_reason
    assert [f.violation for f in paged.findings] == [f.violation for f in flat.findings]
    assert [(f.kind, f.request_row, f.position) for f in paged.findings] == \
        [(f.kind, f.request_row, f.position) for f in flat.findings]
    size, table = int(arrays["block_size"]), arrays["block_table"]
    for f in paged.findings:
        if f.kind == "request":
            assert f.block_index == f.position // size
            assert f.block == int(table[f.request_row, f.block_index])
            assert f"block {f.block} (block-table entry {f.block_index}" in f.where()
            assert f.to_dict()["block"] == f.block
    assert all(f.block_index == -1 and "block" not in f.to_dict() for f in flat.findings)


@pytest.mark.parametrize("options", [dict(block_size=4),
                                     dict(block_size=16, num_slots=4096, prompt_len=(40, 120))],
                         ids=["b4", "b16"])
@pytest.mark.parametrize("kind", PAGED_FAULT_KINDS)
def test_every_paged_fault_kind_detected(tmp_path, options, kind):
    synthesis = run(seed=5, requests=40, **options)
    synthesis.inject(kind, 1 if kind in ("swap", "evicted-block") else 2)
    d = roundtrip(tmp_path, synthesis)
    faults = faults_from_dump(d)
    assert {f.kind for f in faults} == {kind}
    result = audit(d, backend="numpy")
    assert result.unattributed == 0
    for outcome in score(faults, result):
        assert outcome.visible and outcome.detected, outcome
        assert outcome.fired_bits & int(EXPECTED_BITS[kind]) == int(EXPECTED_BITS[kind])


def test_block_faults_lose_the_whole_block(tmp_path):
    synthesis = run(seed=5, block_size=4)
    fault = synthesis.inject("slot-zero")[0]
    result = audit(roundtrip(tmp_path, synthesis), backend="numpy")
    low = fault.position // 4 * 4
    hit = sorted(f.position for f in result.findings if f.request_row == fault.request_row)
    assert set(range(low, low + 4)) >= set(hit) and fault.position in hit and len(hit) >= 2
    assert all(f.block == 0 and "the null block" in f.where() for f in result.findings)


def test_evicted_block_is_paged_only_and_config_errors():
    with pytest.raises(SynthError, match="evicted-block.*needs --block-size"):
        run(seed=1).inject("evicted-block")
    with pytest.raises(SynthError, match="--page-size 8 contradicts it"):
        SynthConfig(block_size=4, page_size=8).validate()
    assert SynthConfig(block_size=4).page_size == 4
    assert "block_size" not in SynthConfig().record()


@pytest.mark.parametrize("name", ["d.npz", "d_dir", "d.safetensors"])
def test_block_table_keys_in_every_container(tmp_path, name):
    if name.endswith(".safetensors"):
        pytest.importorskip("safetensors", reason=skip_reasons.SAFETENSORS)
    synthesis = run(seed=2, block_size=4)
    d = roundtrip(tmp_path, synthesis, name)
    np.testing.assert_array_equal(d.block_table, synthesis.table)
    assert d.block_size == 4 and d.req_to_token is None


def test_dump_holds_exactly_one_table(tmp_path):
    arrays = run(seed=2, block_size=4).arrays()
    table = arrays["block_table"]
    cases = [
        (dict(arrays, req_to_token=table), "key block_table: a dump holds one of req_to_token "
                                           "or block_table, not both"),
        ({k: v for k, v in arrays.items() if k != "block_size"}, "key block_size: missing"),
        (dict(arrays, block_size=0), "key block_size: must be >= 1, got 0"),
        ({k: v for k, v in per_token_arrays(arrays).items()} | {"block_size": 4},
         "key block_size: goes with block_table"),
        ({k: v for k, v in arrays.items() if k not in ("block_table", "block_size")},
         "key req_to_token: missing: a dump needs req_to_token, or block_table"),
        (dict(arrays, block_table=table.astype(np.float32)), "key block_table: dtype must be"),
    ]
    for index, (values, message) in enumerate(cases):
        path = str(tmp_path / f"bad{index}.npz")
        with pytest.raises(DumpError, match=message):
            save(path, **values)                        # save refuses what load would
        np.savez(path, kvcanary_dump_version=np.int64(1), **values)   # written by other means
        with pytest.raises(DumpError, match=message):
            load(path)


def test_cli_synth_block_size_and_audit(tmp_path):
    runner = CliRunner()
    out = str(tmp_path / "paged.npz")
    result = runner.invoke(main, ["synth", out, "--block-size", "8", "--requests", "24",
                                  "--inject", "evicted-block", "--inject", "alias"])
    assert result.exit_code == 0, result.output
    assert "block table of 8-slot blocks" in result.output
    d = load(out)
    assert d.block_size == 8 and d.req_to_token is None
    audited = runner.invoke(main, ["audit", out])
    assert audited.exit_code == 1 and "block-table entry" in audited.output
    bad = runner.invoke(main, ["synth", str(tmp_path / "x.npz"), "--inject", "evicted-block"])
    assert bad.exit_code == 2 and "needs --block-size" in bad.output


def test_paged_alias_points_only_at_written_entries(tmp_path):
    """A campaign miss: the aliased block's entry at the target's offset lay past the other
    request's length, and the slot still held its previous occupant's record of the same
    position (only the token differed). Alias now targets written entries only."""
    config = SynthConfig(requests=21, num_slots=4096, max_running=6, block_size=32,
                         sources=3, mode="none", chunk_size=7, prompt_len=(16, 96),
                         output_len=(4, 16), seed=2070196655)
    synthesis = Synthesis(config).run()
    for kind in ("stale-reuse", "alias", "lost-write"):
        synthesis.inject(kind)
    d = roundtrip(tmp_path, synthesis)
    outcomes = score(faults_from_dump(d), audit(d, backend="numpy"))
    assert [(o.kind, o.detected) for o in outcomes] == [
        ("stale-reuse", True), ("alias", True), ("lost-write", True)]
