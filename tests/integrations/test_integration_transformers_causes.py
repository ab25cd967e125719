"""The cause a finding names for readers that did not write the slot: from the allocator's
history (freed while held, handed to another request, remapped, a stale prefix-cache entry),
for every reader of the slot, and never a legitimate engine move (a prefix hit or the engine's
de-duplication onto an identical block) as the cause."""

from __future__ import annotations

import pytest

import skip_reasons

pytest.importorskip("torch", reason=skip_reasons.transformers_extra("torch"))
pytest.importorskip("transformers", reason=skip_reasons.transformers_extra("transformers"))

from test_integration_transformers import (  # noqa: E402
    PAGE,
    PREFIX,
    Fault,
    allocator,
    batching,
    make_model,
    prompts,
    quiet,  # noqa: F401  (autouse fixture)
    run,
)


@pytest.fixture(scope="module")
def model():
    return make_model()


def moved_here(guard, reader, block):
    """How ``reader`` came to hold ``block`` in the guard's allocator history."""
    return guard.session.groups[0].history.got.get(reader, {}).get(block, (None, None))[1]


def test_shared_prefix_block_freed_while_held_names_it_for_every_reader(model, monkeypatch):
    # Block 0 of the first request holds the shared prefix: later requests read it through
    # the engine's de-duplication or a prefix hit, never having written it themselves.
    def pick(io, requests):
        a = allocator(io)
        block = a.block_table[requests[0].state.request_id][0]
        holders = [r for r, blocks in a.block_table.items() if block in blocks]
        if len(holders) < 3:
            return None
        a.pool.free_blocks(a.index, [block])         # while all of them still hold it
        return block

    fault = Fault("before", pick, min_step=3)
    fault.install(monkeypatch)
    guard, outputs = run(model, cb=batching(num_blocks=40))
    block = fault.target
    assert block is not None and len(outputs) == 40
    hits = [f for f in guard.findings() if f.block == block]
    readers = {f.request_id for f in hits}
    assert len(readers) >= 2, [f.describe() for f in guard.findings()[:3]]
    assert any(moved_here(guard, r, block) in ("de-duplicated", "prefix") for r in readers)
    for f in hits:
        assert f"block {block} was freed at step" in f.explanation, f.describe()
        assert "remapped" not in f.explanation
        # a reader that held it then, or a later one that got it through a prefix hit on the
        # hash it left behind
        assert f"while {f.request_id} still held it" in f.explanation or \
            "stale prefix-cache entry" in f.explanation, f.describe()
    assert any(f"while {f.request_id} still held it" in f.explanation for f in hits)


def test_prefix_cache_entry_naming_another_block_is_a_stale_entry(model, monkeypatch):
    # The prefix cache's entry for the shared first block is pointed at a block that holds
    # another request's own tokens: whoever gets it from the cache reads foreign records.
    def pick(io, requests):
        a = allocator(io)
        first = a.block_table.get(requests[0].state.request_id, [])
        ledger = a.ledger
        if not first or first[0] not in ledger.block_to_hash:
            return None
        for rid, blocks in a.block_table.items():
            own = [b for b in blocks[PREFIX // PAGE:] if b in ledger.block_to_hash]
            if own and own[0] not in first:
                ledger.hash_to_block[ledger.block_to_hash[first[0]]] = own[0]
                return own[0], rid
        return None

    fault = Fault("before", pick, min_step=2)
    fault.install(monkeypatch)
    guard, _ = run(model, cb=batching(num_blocks=200))
    assert fault.target is not None
    block, owner = fault.target
    stale = [f for f in guard.findings() if f.block == block and f.request_id != owner
             and moved_here(guard, f.request_id, block) == "prefix-mismatch"]
    assert stale, [f.describe() for f in guard.findings()[:3]]
    for f in stale:
        assert "stale prefix-cache entry" in f.explanation, f.describe()
        assert f"got block {block} from the prefix cache" in f.explanation


def test_a_legitimate_move_is_never_the_cause(model, monkeypatch):
    """A K flip in a block some readers hold by de-duplication or a prefix hit: each reader
    is told the bytes changed, none that its entry was remapped."""
    def pick(io, requests):
        a = allocator(io)
        block = a.block_table[requests[0].state.request_id][0]
        holders = [r for r, blocks in a.block_table.items() if block in blocks]
        if len(holders) < 3:
            return None
        token_bytes = a.num_key_value_heads * a.head_dim * a.cache_dtype.itemsize
        a._copy_view[block, 2 * token_bytes + 1] ^= 0x04     # layer 0 K of offset 2
        return block

    fault = Fault("before", pick, min_step=3)
    fault.install(monkeypatch)
    guard, _ = run(model, cb=batching(num_blocks=200))
    hits = [f for f in guard.findings() if f.block == fault.target]
    assert len({f.request_id for f in hits}) >= 2
    assert all("remapped" not in f.explanation and "changed after they were written"
               in f.explanation for f in hits), [f.describe() for f in hits[:2]]
