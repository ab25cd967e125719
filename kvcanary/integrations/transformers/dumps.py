"""A guarded step as a kvcanary dump: the arrays ``kvcanary.dump.save`` takes, from one
cache group's session (its canary, its requests' block tables and lengths, the real-KV
sources it hashes and, with the token check, the tokens it expects)."""

from __future__ import annotations

import numpy as np

from ... import RealKvHashMode
from ...model.types import to_host


def last_requests(batch, lengths) -> list:
    """A checked step's requests as ``(request id, its blocks, its length, its token ids)``
    (``batch``: the step's :class:`~.stepbatch.StepBatch`, ``lengths`` each one's length)."""
    return [(rec.request_id, blocks, length, tokens) for rec, blocks, length, tokens in
            zip(batch.recs, batch.blocks.lists(), lengths.tolist(), batch.token_views)]


def dump_arrays(session) -> dict:
    """The arrays of ``session``'s last guarded step, as ``kvcanary.dump.save`` takes them."""
    last = session.last
    n = len(last)
    arrays = dict(
        kvcanary_dump_version=1,
        canary=np.ascontiguousarray(to_host(session.context.canary_buf)),
        **session.dump_table(last),
        req_pool_indices=np.arange(1, n + 1, dtype=np.int64),
        seq_lens=np.array([length for _, _, length, _ in last], dtype=np.int64),
        launch_tag=session.launch_tag.name)
    if session.real_kv and session.guard.hash_mode != RealKvHashMode.NONE:
        for i, (_, source) in enumerate(session.real_kv):
            arrays[f"real_kv_{i}"] = np.ascontiguousarray(to_host(source.tensor))
        arrays["real_kv_params"] = np.array(
            [[s.page_size, s.num_bytes_per_token, s.read_bytes] for _, s in session.real_kv],
            dtype=np.int64)
        arrays["real_kv_hash_mode"] = session.guard.hash_mode.name.lower()
    if session.guard.check_tokens:
        length = max(1, max(t.size for _, _, _, t in last))
        expected = np.full((n + 1, length), -1, dtype=np.int32)
        for i, (_, _, _, tokens) in enumerate(last):
            expected[i + 1, :tokens.size] = tokens
        arrays["expected_tokens"] = expected
        arrays["expected_tokens_valid_lens"] = np.array(
            [t.size for _, _, _, t in last], dtype=np.int64)
    return arrays
