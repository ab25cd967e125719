"""The allocator's history as the guard sees it between steps, for naming the cause of a record
that is not the reader's own.

Before each step :class:`AllocatorHistory` compares the engine's block tables, free pool and
prefix-cache ledger with those of the step before and notes, per block, what happened to it:

* ``freed``: the block is in the free pool while a request's table still holds it;
* ``handed``: the pool gave the block to a request (a fresh allocation, not a prefix hit, a
  fork's share or de-duplication) while another request still held it;
* ``remapped``: a request's table entry changed to another block, and not by the engine's
  de-duplication (the new block's content hash is not the hash of the request's tokens there);
* ``prefix``: a request got the block from the prefix cache (noted as a mismatch when the
  block's content hash is not that of the request's tokens: a stale prefix-cache entry);
* a fork's copies: which block each copied block came from and who held it then (a child's
  copy of a block its parent did not hold is the fork's fault);
* ``fork-share``: a fork child got the block by sharing its parent's block (with block
  sharing, a child shares its parent's fully written first blocks), noted from the fork
  itself, never taken for a prefix hit: a finding there names the fork, not the prefix cache.

Legitimate engine moves (a prefix hit, a fork's share, de-duplication onto an identical
block, offloading and restoring) are noted only as how a request came to hold a block, never
as a cause. What is kept is bounded by the pool: per block its last few events, per request its
table of the last step (dropped when the request leaves the tables).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain

from ... import Diagnosis
from ...findings.causes import Cause

EVENTS_PER_BLOCK = 4


class AllocatorHistory:
    """Per block: the last ``EVENTS_PER_BLOCK`` events ``(step, kind, requests, others)``
    (``requests``: who held it then; ``others``: who it was handed to); per request:
    its table at the last step and, per block it holds, how and when it got it
    (``(step, how)``, for a fork share ``(step of the fork, "fork-share", parent)``)."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.page = int(allocator.tokens_per_page)
        self.tables: dict = {}      # request id -> tuple of blocks at the last step
        self.events: dict = {}      # block -> [(step, kind, requests)]
        self.got: dict = {}         # request id -> {block: (step, how)}
        self.copies: dict = {}      # block -> (source block, who held the source) of a fork
        self.shares: dict = {}      # child -> (parent, step, shared blocks) of forks since
        #                             the last step (the child is seen in the tables then)

    def note_fork(self, parent: str, child: str, fresh: int, step: int) -> None:
        """The engine forked ``child`` from ``parent`` after ``step``: the child's table
        holds the parent's first blocks, all but its last ``fresh`` (which are copies)."""
        table = self.allocator.block_table.get(child, ())
        shared = table[:len(table) - fresh]
        self.shares[child] = (parent, step, frozenset(int(b) for b in shared))

    def note_copies(self, source_blocks, dest_blocks) -> None:
        """A fork copied ``source_blocks`` into ``dest_blocks``: keep who held each source, so a
        child whose copy came from a block its parent did not hold is told so."""
        holders = defaultdict(list)
        for rid, blocks in self.allocator.block_table.items():
            for b in set(blocks):
                holders[int(b)].append(rid)
        for src, dst in zip(source_blocks, dest_blocks):
            self.copies[int(dst)] = (int(src), tuple(sorted(holders.get(int(src), ()))))

    def _note(self, block: int, step: int, kind: str, requests, others=()) -> None:
        events = self.events.setdefault(block, [])
        requests, others = tuple(sorted(requests)), tuple(sorted(others))
        if events and events[-1][1:] == (kind, requests, others):
            return                  # the same state seen again at a later step
        events.append((step, kind, requests, others))
        del events[:-EVENTS_PER_BLOCK]

    def observe(self, step: int, tokens_of) -> None:
        """Compare the allocator with the last step. ``tokens_of(request_id)``: the request's
        token ids (prompt + generated), or None when the engine no longer knows it."""
        a = self.allocator
        last = self.tables
        tables = {rid: tuple(blocks) for rid, blocks in a.block_table.items()}
        # Only a new or changed table has blocks to look at: every block of a table that is
        # the same as at the last step was seen then (``got`` holds exactly the requests of
        # the last step's tables).
        changed = [rid for rid, blocks in tables.items() if blocks != last.get(rid)]
        for rid in changed:
            tables[rid] = tuple(map(int, tables[rid]))
        holders = _Holders(tables)
        hashes = a.ledger.block_to_hash
        fresh = defaultdict(list)   # block -> requests the pool gave it to this step
        for rid in changed:
            blocks, old = tables[rid], last.get(rid)
            got = self.got.setdefault(rid, {})
            share = self.shares.get(rid) if old is None else None
            for i, b in enumerate(blocks):
                if b in got and (old is None or i >= len(old) or old[i] == b):
                    continue
                if share is not None and b in share[2]:
                    got[b] = (share[1], "fork-share", share[0])
                    continue
                legit = self._hash_matches(blocks, i, tokens_of(rid))
                if old is not None and i < len(old) and old[i] != b:
                    if legit:
                        got[b] = (step, "de-duplicated")
                    else:
                        got[b] = (step, "remapped")
                        self._note(b, step, "remapped", (rid,))
                elif old is None and (b in hashes or len(holders.of(b, every=True)) > 1):
                    # The engine shares a block with a new request only through a prefix hit.
                    got[b] = (step, "prefix" if legit else "prefix-mismatch")
                else:
                    got[b] = (step, "allocated")
                    fresh[b].append(rid)
        held = set(chain.from_iterable(tables.values()))
        free = chain.from_iterable(a.pool._free_blocks[a.index].trees.values())
        for b in sorted(held.intersection(free)):
            self._note(b, step, "freed", holders.of(b))
        for b, given in fresh.items():
            before = [rid for rid in holders.of(b) if rid not in given]
            if before:              # handed out by the pool while others still held it
                self._note(b, step, "handed", before, given)
        if len(self.got) > len(tables):
            for rid in set(self.got) - set(tables):
                del self.got[rid]
        self.shares.clear()         # every fork since the last step is in these tables
        self.tables = tables

    def _hash_matches(self, blocks, i: int, tokens) -> bool:
        """Whether block ``blocks[i]``'s content hash is the hash of the request's tokens of
        that block (the engine's rule for prefix hits and de-duplication)."""
        from transformers.generation.continuous_batching.cache_allocators.cache_allocator import (
            compute_block_hash,
        )

        hashes = self.allocator.ledger.block_to_hash
        have = hashes.get(blocks[i])
        if have is None or tokens is None or len(tokens) < (i + 1) * self.page:
            return False
        parent = hashes.get(blocks[i - 1]) if i else None
        if i and parent is None:
            return False
        return have == compute_block_hash(parent, list(tokens[i * self.page:(i + 1) * self.page]))

    def cause(self, reader: str, block: int, writer) -> Diagnosis | None:
        """The cause, from the history, that ``reader`` finds another record (``writer``:
        ``(request, position, step, followed)`` of the slot's last write) in ``block``, as a
        :class:`~kvcanary.Diagnosis`; None when the history names none (then the facts alone
        are stated)."""
        how = self.got.get(reader, {}).get(block)
        then = "" if writer is None else (
            f", then {writer[0]} wrote its position {writer[1]} there at step {writer[2]}")
        copied = self.copies.get(block)
        parent = reader.rsplit("__child#", 1)[0] if "__child#" in reader else None
        if copied is not None and parent is not None and parent not in copied[1] and \
                how is not None and how[1] == "allocated":
            src, held = copied
            return Diagnosis.of(Cause.FORK_COPIED_WRONG_BLOCK, parent=parent, source=src,
                                request=reader, block=block,
                                holders=", ".join(held) or "nobody")
        events = [e for e in self.events.get(block, ()) if reader in e[2]]
        kinds = {kind: (step, others) for step, kind, _, others in events}   # the latest
        shared = how is not None and how[1] == "fork-share"
        if "freed" in kinds:
            if shared:
                return Diagnosis.of(Cause.FREED_WHILE_HELD, "fork-share", block=block,
                                    step=kinds["freed"][0], request=reader, parent=how[2],
                                    fork_step=how[0], then=then)
            return Diagnosis.of(Cause.FREED_WHILE_HELD, block=block, step=kinds["freed"][0],
                                request=reader, then=then)
        if "remapped" in kinds:
            return Diagnosis.of(Cause.REMAPPED, "history", request=reader, block=block,
                                step=kinds["remapped"][0])
        if "handed" in kinds:
            step, others = kinds["handed"]
            if shared:
                return Diagnosis.of(Cause.HANDED_TO_ANOTHER, "fork-share", block=block,
                                    others=", ".join(others), step=step, request=reader,
                                    parent=how[2], fork_step=how[0], then=then)
            return Diagnosis.of(Cause.HANDED_TO_ANOTHER, block=block, others=", ".join(others),
                                step=step, request=reader, then=then)
        freed = [(step, requests) for step, kind, requests, _ in self.events.get(block, ())
                 if kind in ("freed", "handed")]
        why = "" if not freed else (
            f"; block {block} was freed at step {freed[-1][0]} while "
            f"{', '.join(freed[-1][1])} still held it, and its hash stayed in the cache")
        if shared:
            # Not a prefix hit: the fork shared the block. Only a write after the fork by a
            # request that shares none of it is a cause (one before it is the parent's content).
            if writer is not None and writer[2] <= how[0] and how[2] != reader:
                return self.cause(how[2], block, writer)   # the parent's, if any
            if writer is None or writer[0] in (reader, how[2]):
                return None
            return Diagnosis.of(Cause.OVERWRITTEN, "fork-share", request=reader, block=block,
                                parent=how[2], fork_step=how[0], then=then, why=why)
        if how is not None and how[1] == "prefix":
            return Diagnosis.of(Cause.STALE_PREFIX_ENTRY, request=reader, block=block,
                                step=how[0], then=then, why=why)
        if how is not None and how[1] == "prefix-mismatch":
            return Diagnosis.of(Cause.STALE_PREFIX_ENTRY, "hash-differs", request=reader,
                                block=block, step=how[0], why=why)
        return None

    def move(self, reader: str, block: int) -> str | None:
        """How ``reader`` came to hold ``block`` when that was a legitimate engine move
        (``"de-duplicated"``, ``"prefix"``, a fork's share) and when, else None."""
        how = self.got.get(reader, {}).get(block)
        if how is not None and how[1] == "fork-share":
            return f"shared with its parent {how[2]} by the fork at step {how[0]}"
        if how is None or how[1] not in ("de-duplicated", "prefix"):
            return None
        return f"{how[1]} at step {how[0]}"


class _Holders:
    """Which requests hold a block, from one step's tables: looked up per block (a step
    asks about a few blocks), or all at once when a step asks about many (new requests)."""

    def __init__(self, tables: dict):
        self.tables, self.every = tables, None

    def of(self, block: int, every: bool = False) -> list:
        if every and self.every is None:
            self.every = defaultdict(list)
            for rid, blocks in self.tables.items():
                for b in set(blocks):
                    self.every[b].append(rid)
        if self.every is not None:
            return self.every.get(block, [])
        return [rid for rid, blocks in self.tables.items() if block in blocks]
