"""Causes of a finding that only vLLM's bookkeeping can name: how the request got the block
(its own allocation, a prefix-cache hit when it was admitted, a hit when it was resumed after
preemption), who wrote the slot since, and what vLLM's block pool says about the block now.
Each is a member of the one vocabulary (:class:`~kvcanary.findings.causes.Cause`) rendered
from vLLM's evidence; everything else is the shared explanation
(:func:`kvcanary.integrations.findings.explain`)."""

from __future__ import annotations

from ... import Diagnosis
from ...findings.causes import Cause

_TOKEN = "verify_token"
_REAL_KV = "verify_real_kv_hash"


def _pool_state(session, block: int) -> str:
    """vLLM's view of ``block``: its reference count and which live requests map it."""
    pool = getattr(session.scheduler.kv_cache_manager, "block_pool", None)
    ref = None
    if pool is not None and 0 <= block < len(pool.blocks):
        ref = int(pool.blocks[block].ref_cnt)
    mapping = sorted(rid for rid, groups in session.tables.items()
                     if any(block in blocks for blocks in groups))
    held = f"ref_cnt {ref}" if ref is not None else "no ref_cnt"
    return f"vLLM's block pool gives block {block} {held}; the live tables mapping it: " \
           f"{', '.join(mapping) or 'none'}"


def vllm_cause(session, sighting, ev, row) -> Diagnosis | None:
    """The cause in vLLM's terms (a :class:`~kvcanary.Diagnosis` of a
    :class:`~kvcanary.findings.causes.Cause`, rendered from vLLM's evidence), or None to
    leave it to the shared explanation."""
    reasons = sighting.reasons
    bs = session.block_size
    if "slot_zero_in_prefix" in reasons:
        return Diagnosis.of(Cause.SLOT_ZERO, "vllm", request=ev.request_id,
                            position=ev.position, group=row.group)
    if not any(r.startswith("verify_") for r in reasons) or reasons == (_REAL_KV,):
        return None     # a changed KV byte alone: the bytes, not the bookkeeping
    block = ev.slot // bs
    index = ev.position // bs
    how, since = session.origin.get(ev.request_id, {}).get((row.group, index), ("own", None))
    writer = ev.writer
    if writer is None or writer[0] == ev.request_id or not writer[3]:
        return None     # a write the slot_mapping misdirected: the shared explanation
    other, their_position, step = writer[0], writer[1], writer[2]
    pool = _pool_state(session, block)
    if how == "own":
        return Diagnosis.of(Cause.FREED_WHILE_HELD, "vllm", block=block, request=ev.request_id,
                            position=ev.position, writer=other, writer_position=their_position,
                            writer_step=step, pool=pool)
    if step > since:
        return Diagnosis.of(Cause.HANDED_TO_ANOTHER, "cached", request=ev.request_id,
                            block=block, since=since, writer=other,
                            writer_position=their_position, writer_step=step, pool=pool)
    if how == "resumed":
        return Diagnosis.of(Cause.RESUMED_WRONG_BLOCKS, "vllm", request=ev.request_id,
                            since=since, block=block, writer=other,
                            writer_position=their_position, writer_step=step,
                            position=ev.position)
    if _TOKEN in reasons or sighting.violation is not None:
        return Diagnosis.of(Cause.PREFIX_COLLISION, "vllm", request=ev.request_id, block=block,
                            since=since, first=index * bs, last=index * bs + bs - 1,
                            writer=other, writer_step=step)
    return None
