"""Causes of a finding that only vLLM's bookkeeping can name: how the request got the block
(its own allocation, a prefix-cache hit when it was admitted, a hit when it was resumed after
preemption), who wrote the slot since, and what vLLM's block pool says about the block now.
Everything else is the shared explanation (:func:`kvcanary.integrations.findings.explain`)."""

from __future__ import annotations

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


def vllm_cause(session, sighting, ev, row) -> str | None:
    """The cause in vLLM's terms, or None to leave it to the shared explanation."""
    reasons = sighting.reasons
    bs = session.block_size
    if "slot_zero_in_prefix" in reasons:
        return (f"{ev.request_id} reads position {ev.position} (group {row.group}) from vLLM's "
                "null block 0: its block table names the null block where the block holding "
                "that position belongs, so attention reads padding instead of its KV")
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
        return (f"block {block} of {ev.request_id} (position {ev.position}, which it wrote "
                f"itself) was handed to {other}, which wrote its position {their_position} "
                f"there at step {step} while {ev.request_id} still maps the block: a block "
                f"freed while still referenced, then reused ({pool})")
    if step > since:
        return (f"{ev.request_id} got block {block} from the prefix cache at step {since}; "
                f"{other} wrote its position {their_position} there at step {step}, while "
                f"{ev.request_id} still maps the block: an evicted cached block handed out to "
                f"another request while a running request maps it ({pool})")
    if how == "resumed":
        return (f"{ev.request_id} was resumed after preemption at step {since} onto block "
                f"{block}, which holds {other}'s position {their_position} (written at step "
                f"{step}), not its own position {ev.position}: a preempted request resumed "
                "onto the wrong blocks")
    if _TOKEN in reasons or sighting.violation is not None:
        return (f"prefix-cache hash collision: {ev.request_id} hit cached block {block} at step "
                f"{since} for its positions {index * bs}..{index * bs + bs - 1}, but the block "
                f"holds {other}'s tokens (written at step {step}), which differ from "
                f"{ev.request_id}'s: two different prefixes map to one cached block")
    return None
