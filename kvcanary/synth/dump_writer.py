"""The dump of a run: its running requests are the live requests, its prefix-cache blocks the
sweep entries, its faults the ground truth under ``synth_`` keys."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np

from .fault_kinds import PAIR_SHAPES, fault_kinds
from .fault_sites import SWEEP, TARGET_CLASSES
from .prefix_cache import SweepIndex


def live_requests(running) -> tuple:
    """``(req_pool_indices, seq_lens)`` of the running requests."""
    rows = np.array([r.row for r in running], dtype=np.int64)
    seq_lens = np.array([r.seq_len for r in running], dtype=np.int64)
    return rows, seq_lens


def sweep_entries(cache, lut):
    """``(slots, prev_slots, positions)`` of every cached block's entries (canary slots), or
    None when the cache is empty; a block's first entry links to its parent's last."""
    index = SweepIndex(cache, lut)
    if index.slots.shape[0] == 0:
        return None
    return index.slots, index.prevs, index.positions


def dump_arrays(synthesis) -> dict:
    """The dump keys (for ``kvcanary.dump.save``) of a synthesis's current state."""
    s, c = synthesis, synthesis.config
    rows, seq_lens = live_requests(s.running)
    out = {
        "canary": s.canary,
        **s.scheduler.table.dump_keys(),
        "req_pool_indices": rows,
        "seq_lens": seq_lens,
        "launch_tag": s.pool.tag.name,
        "expected_tokens": s.token_pool,
        "expected_tokens_valid_lens": seq_lens.copy(),
    }
    if s.sources:
        for index, tensor in enumerate(s.sources):
            out[f"real_kv_{index}"] = tensor
        out["real_kv_params"] = np.array(
            [[c.page_size, c.bytes_per_token, c.bytes_per_token]] * len(s.sources),
            dtype=np.int64)
        out["real_kv_hash_mode"] = c.mode
    if c.swa_window > 0:
        out["swa_window_size"] = np.array(c.swa_window, dtype=np.int64)
        out["full_to_swa_index_mapping"] = s.lut
    sweep = sweep_entries(s.cache, s.lut)
    if sweep is not None:
        out["sweep_slot_indices"], out["sweep_prev_slot_indices"], out["sweep_positions"] = sweep
    out["synth_config"] = json.dumps(c.record(), sort_keys=True)
    out["synth_stats"] = json.dumps(asdict(s.stats), sort_keys=True)
    kinds = fault_kinds(c.paged)
    out["synth_fault_kinds"] = ",".join(kinds)
    f = s.faults
    out["synth_fault_kind"] = np.array([kinds.index(x.kind) for x in f], dtype=np.int64)
    for name in ("batch_index", "request_row", "position", "slot", "expected_bits", "detail"):
        out[f"synth_fault_{name}"] = np.array([getattr(x, name) for x in f], dtype=np.int64)
    out["synth_fault_visible"] = np.array([int(x.visible) for x in f], dtype=np.int64)
    targets = TARGET_CLASSES + PAIR_SHAPES
    out["synth_fault_targets"] = ",".join(targets)
    out["synth_fault_target"] = np.array([targets.index(x.target) for x in f], dtype=np.int64)
    # Sites, fault after fault: the entries each must fire at (sweep entries have row -1).
    sites = [site for x in f for site in x.sites]
    out["synth_fault_site_count"] = np.array([len(x.sites) for x in f], dtype=np.int64)
    out["synth_fault_site_sweep"] = np.array([int(x.entry == SWEEP) for x in sites],
                                             dtype=np.int64)
    for name in ("request_row", "position", "slot", "bits"):
        out[f"synth_fault_site_{name}"] = np.array([getattr(x, name) for x in sites],
                                                   dtype=np.int64)
    return out
