"""The live entries verified once per distinct entry: many requests reading the same block at
the same positions (a shared prefix, a copied table row, batch entries on one row) cost what
the block costs, and every row found there is attributed to each of its readers.

A live request's entry at position ``p`` of table row ``r`` is fixed by the block-table
column ``j = p // block_size``, the block there, the block before it (the first entry's
predecessor) and, where the token is known, the token-pool row ``r``. The requests' ranges
are cut into *pieces* (one block column, one token variant, one set of readers each) and
pieces with the same key share a *group*, verified once over the positions its pieces cover.
Work and memory follow the pieces (at most a few per table cell and per request) and the
distinct entries, never the entries the requests claim.

A claim no engine state could make is refused: more distinct live entries than twice the
canary's slots plus :data:`DISTINCT_ENTRIES_FLOOR` (an engine's live requests read each slot
at one position; a fault may add some, not billions)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dump import Dump
from ..backends.reference.plan import table_entries, verify_entries
from .launches import Entries, Launch, Launcher, LiveRequests, plan_errors, slot_zero_rows, verify_rows
from .matching import attribute_rows, row_groups
from .result import AuditError, CheckedLaunch

# Distinct live entries allowed beyond twice the canary's slots (a small dump's faults).
DISTINCT_ENTRIES_FLOOR = 1 << 24
# Claimed live entries up to which the audit plans every request as it is (no grouping).
GROUPING_THRESHOLD = 1 << 18
# Grouping is used when the requests claim at least this many times the distinct entries.
MIN_SHARING = 2
# Readers of one entry the diagnosis is shown (the other readers are counted, not listed).
EVIDENCE_READERS = 16


@dataclass
class _Readers:
    """Per live request: table row, known-token range ``[ws, kend)``, unknown-token range
    ``[kend, sl)``, and the piece index ranges covering each."""

    batch_index: np.ndarray
    rows: np.ndarray
    ranges: np.ndarray      # [n, 2 variants, 2] positions (variant 0: unknown, 1: known)
    pieces: np.ndarray      # [n, 2 variants, 2] piece index ranges


@dataclass
class _Pieces:
    """Sorted by (row, variant, lo): positions ``[lo, hi)`` of one block column, the group
    verifying them and the global index of ``lo`` in the group's entries, and how many
    requests read the piece."""

    row: np.ndarray
    variant: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    group: np.ndarray
    offset: np.ndarray
    cover: np.ndarray


@dataclass
class DistinctLive:
    """The live entries of a dump grouped: groups to verify (a representative row, the
    first position, how many positions, the token variant), pieces and readers."""

    group_row: np.ndarray
    group_start: np.ndarray
    group_size: np.ndarray
    group_known: np.ndarray
    pieces: _Pieces
    readers: _Readers

    @property
    def entries(self) -> int:
        return int(self.group_size.sum())


def _valid_ends(d: Dump, rows: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """Positions before which a request's token is known (0 without a token pool)."""
    pool = d.expected_tokens
    if pool is None:
        return np.zeros(rows.size, dtype=np.int64)
    inside = (rows >= 0) & (rows < pool.shape[0])
    ends = np.minimum(np.asarray(d.expected_tokens_valid_lens, dtype=np.int64)[batch],
                      pool.shape[1])
    return np.where(inside, np.maximum(ends, 0), 0)


def group_live(d: Dump, live: LiveRequests) -> DistinctLive | None:
    """Pieces and groups of the live requests (see the module docstring); None when no
    request's positions repeat on its row and the pieces would be as many as the entries
    (a per-token table read once: planning each request costs no more, and its table bounds
    it)."""
    bs = int(d.block_size)
    batch = live.batch_index
    rows = np.asarray(d.req_pool_indices, dtype=np.int64)[batch]
    ends = np.asarray(d.seq_lens, dtype=np.int64)[batch]
    starts = ends - live.lengths
    known_end = np.clip(_valid_ends(d, rows, batch), starts, ends)
    ranges = np.stack([np.stack([known_end, ends], axis=1),
                       np.stack([starts, known_end], axis=1)], axis=1)   # [n, variant, 2]
    # Interval endpoints per (row, variant): coverage between consecutive endpoints.
    n = batch.size
    ev_row = np.repeat(rows, 4)
    ev_variant = np.tile(np.array([0, 0, 1, 1]), n)
    ev_pos = ranges.reshape(-1)
    ev_delta = np.tile(np.array([1, -1, 1, -1]), n)
    nonempty = np.repeat((ranges[:, :, 1] > ranges[:, :, 0]).reshape(-1), 2)
    ev_row, ev_variant, ev_pos, ev_delta = (a[nonempty] for a in (ev_row, ev_variant, ev_pos,
                                                                  ev_delta))
    order = np.lexsort((ev_pos, ev_variant, ev_row))
    ev_row, ev_variant, ev_pos, ev_delta = (a[order] for a in (ev_row, ev_variant, ev_pos,
                                                               ev_delta))
    cover = np.cumsum(ev_delta)
    same_next = np.zeros(ev_row.size, dtype=bool)
    same_next[:-1] = (ev_row[1:] == ev_row[:-1]) & (ev_variant[1:] == ev_variant[:-1])
    seg_hi = np.append(ev_pos[1:], 0)
    keep = same_next & (cover > 0) & (seg_hi > ev_pos)
    s_row, s_var, s_lo, s_hi, s_cover = (ev_row[keep], ev_variant[keep], ev_pos[keep],
                                         seg_hi[keep], cover[keep])
    # Each elementary segment cut at the block boundaries: one piece per block column.
    first_col, last_col = s_lo // bs, (s_hi - 1) // bs
    count = last_col - first_col + 1
    claimed = int(live.lengths.sum())
    if MIN_SHARING * int((s_hi - s_lo).sum()) > claimed \
            and MIN_SHARING * int(count.sum()) > claimed:
        return None   # each row is read once and a piece costs what an entry costs
    p_seg = np.repeat(np.arange(s_lo.size), count)
    p_col = np.repeat(first_col - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
    p_lo = np.maximum(s_lo[p_seg], p_col * bs)
    p_hi = np.minimum(s_hi[p_seg], (p_col + 1) * bs)
    p_row, p_var, p_cover = s_row[p_seg], s_var[p_seg], s_cover[p_seg]
    # The key: column, its block, the block before it, the token row where tokens are known.
    table = d.slot_table
    cell = table_entries(table, p_row, p_col)
    prev_cell = np.where(p_col > 0, table_entries(table, p_row, p_col - 1), -2)
    token_row = np.where(p_var == 1, p_row, -1)
    if p_lo.size:
        group = row_groups(np.stack([p_col, cell, prev_cell, token_row], axis=1))
    else:
        group = np.zeros(0, dtype=np.int64)
    groups = int(group.max()) + 1 if group.size else 0
    g_start = np.full(groups, np.iinfo(np.int64).max, dtype=np.int64)
    g_end = np.zeros(groups, dtype=np.int64)
    np.minimum.at(g_start, group, p_lo)
    np.maximum.at(g_end, group, p_hi)
    g_row = np.zeros(groups, dtype=np.int64)
    g_row[group[::-1]] = p_row[::-1]
    g_known = np.zeros(groups, dtype=bool)
    g_known[group] = p_var == 1
    g_size = g_end - g_start
    g_offset = np.cumsum(g_size) - g_size
    pieces = _Pieces(row=p_row, variant=p_var, lo=p_lo, hi=p_hi, group=group,
                     offset=g_offset[group] + p_lo - g_start[group], cover=p_cover)
    readers = _Readers(batch_index=batch, rows=rows, ranges=ranges,
                       pieces=_piece_ranges(pieces, rows, ranges))
    return DistinctLive(g_row, g_start, g_size, g_known, pieces, readers)


def _piece_ranges(p: _Pieces, rows: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """Per request and variant, the range of sorted pieces its positions cover (pieces are
    cut at every request's endpoints, so a request's positions are whole pieces)."""
    # A monotone key over the sorted pieces: (row, variant) segments laid end to end.
    rt = p.row * 2 + p.variant
    heads = np.flatnonzero(np.diff(rt, prepend=-1)) if rt.size else np.zeros(0, np.int64)
    seg_rt = rt[heads]
    seg_lo = p.lo[heads]
    seg_span = np.maximum.reduceat(p.hi, heads) - seg_lo + 1 if rt.size else seg_lo
    seg_base = np.cumsum(seg_span) - seg_span
    seg_of = np.repeat(np.arange(heads.size), np.diff(np.append(heads, rt.size)))
    key = seg_base[seg_of] + p.lo - seg_lo[seg_of] if rt.size else rt
    result = np.zeros(ranges.shape, dtype=np.int64)
    for variant in (0, 1):
        q_rt = rows * 2 + variant
        seg = np.minimum(np.searchsorted(seg_rt, q_rt), max(heads.size - 1, 0))
        found = (seg_rt[seg] == q_rt) if heads.size else np.zeros(rows.size, bool)
        for side in (0, 1):
            position = ranges[:, variant, side]
            q = seg_base[seg] + position - seg_lo[seg] if heads.size else position
            result[:, variant, side] = np.where(found, np.searchsorted(key, q), 0)
        empty = ranges[:, variant, 1] <= ranges[:, variant, 0]
        result[empty, variant] = 0
    return result


def claim_limit(d: Dump) -> int:
    """The most distinct live entries an engine state could give (see the module)."""
    return 2 * d.num_slots + DISTINCT_ENTRIES_FLOOR


def check_claim(d: Dump, grouped: DistinctLive) -> None:
    """Refuse more distinct live entries than any engine state could hold."""
    if grouped.entries > claim_limit(d):
        raise AuditError(
            f"{d.path}: key seq_lens: the live requests read {grouped.entries} distinct "
            f"entries (block, position, predecessor, token), more than twice the canary's "
            f"{d.num_slots} slots plus {DISTINCT_ENTRIES_FLOOR}: no engine's state maps that "
            "many; the tables or lengths are corrupt")


def distinct_launches(d: Dump, launcher: Launcher, grouped: DistinctLive, chunk: int):
    """``(first global entry, launch)``: the groups' entries, ``chunk`` at a time."""
    size, total = grouped.group_size, grouped.entries
    ends = np.cumsum(size)
    begins = ends - size
    check_token = d.expected_tokens is not None
    for first in range(0, total, chunk):
        last = min(total, first + chunk)
        lo_g = int(np.searchsorted(ends, first, side="right"))
        hi_g = int(np.searchsorted(begins, last, side="left"))
        g = np.arange(lo_g, hi_g)
        skip = np.maximum(first - begins[g], 0)
        take = np.minimum(ends[g], last) - begins[g] - skip
        starts = grouped.group_start[g] + skip
        valid = np.where(grouped.group_known[g], starts + take, 0)
        with plan_errors(d):
            slots, positions, prevs, tokens = verify_entries(
                d.slot_table, d.block_size, d.full_to_swa_index_mapping, grouped.group_row[g],
                starts, take, int(take.sum()), d.expected_tokens, valid, 0)
        entries = Entries(slots, prevs, positions, tokens)
        yield first, Launch(int(d.launch_tag), entries.plan(launcher.device), entries,
                             check_token, batch_index=np.full(slots.size, -1, np.int64))


@dataclass
class DistinctRows:
    """What verifying the groups found: per global entry whether it failed, the failing
    entries' rows (sorted by entry), how many requests read each entry, and the rows no
    entry reproduces."""

    failing: np.ndarray          # bool [entries]
    row_index: np.ndarray        # global entries of the failing rows, sorted
    rows: np.ndarray             # their rows, [n, 8]
    readers: np.ndarray          # int64 [entries]: requests reading each entry
    unattributed: np.ndarray     # [m, 8]

    def row_of(self, entries: np.ndarray) -> np.ndarray:
        return self.rows[np.searchsorted(self.row_index, entries)]


def verify_groups(d: Dump, launcher: Launcher, grouped: DistinctLive, chunk: int,
                  compat: bool, observe=None, progress=None, total: int = 0) -> DistinctRows:
    """Verify every group once; attribute each row to its global entry."""
    failing = np.zeros(grouped.entries, dtype=bool)
    indices, kept, unattributed = [], [], []
    check_token = d.expected_tokens is not None
    reader_of = np.repeat(_group_readers(grouped), grouped.group_size) if observe else None
    done = 0
    for first, launch in distinct_launches(d, launcher, grouped, chunk):
        rows = verify_rows(launcher, launch)
        entry_of = attribute_rows(rows, launch, launcher)
        if not compat:
            zero_rows, zero_entries = slot_zero_rows(launch.entries, launch.tag, check_token)
            rows = np.concatenate([rows, zero_rows])
            entry_of = np.concatenate([entry_of, zero_entries])
        claims = np.flatnonzero(entry_of >= 0)[::-1]
        row_of = np.full(launch.size, -1, dtype=np.int64)
        row_of[entry_of[claims]] = claims            # reversed: the first claim wins
        hit = np.flatnonzero(row_of >= 0)
        attributed = np.zeros(rows.shape[0], dtype=bool)
        attributed[row_of[hit]] = True
        unattributed.append(rows[~attributed])
        failing[first + hit] = True
        indices.append(first + hit)
        kept.append(rows[row_of[hit]])
        if observe:
            observe(CheckedLaunch(launch.entries.slots, launch.entries.positions,
                                  reader_of[first:first + launch.size], rows,
                                  np.where(attributed, entry_of, -1)))
        if progress:
            done += launch.size
            progress(done, total)
    p = grouped.pieces
    diff = np.zeros(grouped.entries + 1, dtype=np.int64)
    np.add.at(diff, p.offset, p.cover)
    np.add.at(diff, p.offset + p.hi - p.lo, -p.cover)
    readers = np.cumsum(diff[:-1])
    # A group verifies the positions between its pieces too; a row there has no reader.
    failing &= readers > 0
    row_index = np.concatenate(indices or [np.zeros(0, np.int64)])
    rows = np.concatenate(kept or [np.zeros((0, 8), np.int64)])
    read = readers[row_index] > 0
    return DistinctRows(failing, row_index[read], rows[read], readers,
                        np.concatenate(unattributed or [np.zeros((0, 8), np.int64)]))


def _piece_readers(grouped: DistinctLive) -> np.ndarray:
    """One request reading each piece (the covering request whose piece range reaches
    furthest; every piece has one)."""
    r, p = grouped.readers, grouped.pieces
    result = np.full(p.lo.size, -1, dtype=np.int64)
    n = r.batch_index.size
    for variant in (0, 1):
        first, last = r.pieces[:, variant, 0], r.pieces[:, variant, 1]
        has = np.flatnonzero(last > first)
        if not has.size or not p.lo.size:
            continue
        order = has[np.argsort(first[has], kind="stable")]
        # Running best (furthest end) among the requests starting at or before each piece.
        best = np.maximum.accumulate(last[order] * (n + 1) + order)
        at = np.searchsorted(first[order], np.arange(p.lo.size), side="right") - 1
        valid = at >= 0
        reach, who = np.divmod(best[np.maximum(at, 0)], n + 1)
        covered = valid & (reach > np.arange(p.lo.size)) & (p.variant == variant)
        result[covered] = r.batch_index[who[covered]]
    return result


def _group_readers(grouped: DistinctLive) -> np.ndarray:
    """One request per group (its first piece's reader): the report maps' batch index."""
    readers = _piece_readers(grouped)
    result = np.full(grouped.group_size.size, -1, dtype=np.int64)
    result[grouped.pieces.group[::-1]] = readers[::-1]
    return result


def request_counts(grouped: DistinctLive, found: DistinctRows) -> tuple:
    """``(violations, first position, last position)`` per live request, over its own
    positions of the entries it shares."""
    p, r = grouped.pieces, grouped.readers
    cum = np.concatenate([[0], np.cumsum(found.failing)])
    length = p.hi - p.lo
    per_piece = cum[p.offset + length] - cum[p.offset]
    before = np.concatenate([[0], np.cumsum(per_piece)])
    nonzero = np.flatnonzero(per_piece)
    count = np.zeros(r.batch_index.size, dtype=np.int64)
    first = np.full(r.batch_index.size, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(r.batch_index.size, -1, dtype=np.int64)
    for variant in (0, 1):
        lo, hi = r.pieces[:, variant, 0], r.pieces[:, variant, 1]
        c = before[hi] - before[lo]
        count += c
        has = np.flatnonzero(c > 0)
        if not has.size:
            continue
        head = nonzero[np.searchsorted(nonzero, lo[has])]
        tail = nonzero[np.searchsorted(nonzero, hi[has]) - 1]
        k_head = np.searchsorted(cum, cum[p.offset[head]], side="right") - 1
        k_tail = np.searchsorted(cum, cum[p.offset[tail] + length[tail]], side="left") - 1
        first[has] = np.minimum(first[has], p.lo[head] + k_head - p.offset[head])
        last[has] = np.maximum(last[has], p.lo[tail] + k_tail - p.offset[tail])
    return count, first, last


def first_findings(grouped: DistinctLive, found: DistinctRows, count: np.ndarray, room: int):
    """``(batch index, request row, position, global entry)`` of the first ``room`` failing
    entries, request by request (batch order) and position by position."""
    p, r = grouped.pieces, grouped.readers
    result = []
    for i in np.flatnonzero(count).tolist():
        for variant in (1, 0):    # the known-token range comes first in position order
            for piece in range(int(r.pieces[i, variant, 0]), int(r.pieces[i, variant, 1])):
                off, size = int(p.offset[piece]), int(p.hi[piece] - p.lo[piece])
                hits = np.flatnonzero(found.failing[off:off + size])[:room - len(result)]
                result.extend((int(r.batch_index[i]), int(r.rows[i]), int(p.lo[piece]) + k,
                               off + k) for k in hits.tolist())
                if len(result) >= room:
                    return result
    return result


def entry_readers(grouped: DistinctLive, entries: np.ndarray, positions: np.ndarray) -> tuple:
    """``(entry index, batch index, request row)``: up to :data:`EVIDENCE_READERS` requests
    reading each of the global ``entries`` (at ``positions``), found among the first
    ``4 * EVIDENCE_READERS`` pieces of its group."""
    p = grouped.pieces
    readers = _piece_readers(grouped)
    row_of_batch = dict(zip(grouped.readers.batch_index.tolist(), grouped.readers.rows.tolist()))
    by_group = np.argsort(p.group, kind="stable")
    heads = np.searchsorted(p.group[by_group], np.arange(grouped.group_size.size + 1))
    group_of = np.searchsorted(np.cumsum(grouped.group_size), entries, side="right")
    begin, end = heads[group_of], heads[group_of + 1]
    found = np.zeros(entries.size, dtype=np.int64)
    out_entry, out_batch = [], []
    for rank in range(4 * EVIDENCE_READERS):
        piece = by_group[np.minimum(begin + rank, max(by_group.size - 1, 0))]
        ok = (begin + rank < end) & (found < EVIDENCE_READERS)
        if not ok.any():
            break
        ok &= (p.lo[piece] <= positions) & (positions < p.hi[piece])
        out_entry.append(np.flatnonzero(ok))
        out_batch.append(readers[piece[ok]])
        found += ok
    which = np.concatenate(out_entry or [np.zeros(0, np.int64)])
    batch = np.concatenate(out_batch or [np.zeros(0, np.int64)])
    order = np.argsort(which, kind="stable")
    which, batch = which[order], batch[order]
    rows = np.array([row_of_batch[b] for b in batch.tolist()], dtype=np.int64)
    return which, batch, rows
