"""The three launches of the public API: ``plan``, ``write``, ``verify``.

Each checks its arguments (upstream's messages, in upstream's order), then dispatches by
array library: numpy arrays run the numpy reference, cupy arrays the CUDA kernels.
``backend=`` forces one; arrays of the other library are then copied over and the
outputs copied back, so the call still works in place."""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import numpy as np

from ..model import arrays as A
from ..model import overlap
from ..backends.resolve import backend_module
from ..format.consts import REQ_POOL_IDX_PADDING
from ..format.errors import CanaryError
from ..format.rules import window_start
from ..model.types import CanaryContext, VerifyPlan, WritePlan, to_host

_TABLE_DTYPES = (np.int32, np.int64)
# The dispatch seam (a name the kernel harness can swap for a test backend).
_backend_module = backend_module


def _check_token_array(x, name: str, length: int | None) -> int:
    return A.check_array(x, name, A.INT64, 1, length)


class VerifyPlanTooSmall(UserWarning):
    """A verify plan had less capacity than its batch's prefix entries: upstream's rule then
    disables the launch (``enable = 0``), so that step checks nothing. Warned once per plan
    by :func:`plan`; ``plan(..., strict=True)`` raises ``ValueError`` instead."""


@dataclass(frozen=True)
class PlanReport:
    """What :func:`plan` planned: ``entries_needed`` prefix entries for the batch (the sum
    over live rows of ``prefix_len - window_start``), ``verify_capacity`` of the plan, and
    whether verify will run (``enabled``: the entries fit). ``write_requests`` is the batch
    size the write plan covers."""

    entries_needed: int
    verify_capacity: int
    write_requests: int

    @property
    def enabled(self) -> bool:
        return self.entries_needed <= self.verify_capacity

    def __str__(self) -> str:
        state = "verify enabled" if self.enabled else "verify DISABLED (plan too small)"
        return (f"plan: {self.entries_needed} prefix entries for a capacity of "
                f"{self.verify_capacity}, {self.write_requests} write request(s): {state}")


def entries_needed(req_pool_indices, prefix_lens, swa_window_size: int = 0) -> int:
    """Prefix entries a verify plan needs for a batch: ``sum(prefix_len - window_start)`` over
    the rows whose ``req_pool_indices`` is not the padding row 0 (host arrays or device
    arrays, copied to the host). ``VerifyPlan.allocate`` needs at least this capacity."""
    rows, lens = to_host(req_pool_indices), to_host(prefix_lens).astype(np.int64)
    start = window_start(lens, int(swa_window_size))
    counts = np.where(rows != REQ_POOL_IDX_PADDING, np.maximum(0, lens - start), 0)
    total = int(counts.sum())
    if counts.size and int(counts.max()) > _INT64_MAX // counts.size:   # the sum may wrap
        total = sum(int(c) for c in counts.tolist())
    if total > _INT64_MAX:
        raise CanaryError(f"prefix_lens: the batch's prefix entries sum to {total}, past int64: no "
                          "plan can hold them (a corrupt length?)", key="prefix_lens")
    return total


_INT64_MAX = (1 << 63) - 1


def plan(*, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token=None,
         verify_plan: VerifyPlan, write_plan: WritePlan, swa_window_size: int = 0,
         full_to_swa_index_mapping=None, req_to_verify_expected_tokens=None,
         req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset: int = 0,
         block_table=None, block_size=None, backend: str | None = None,
         strict: bool = False, check_capacity: bool | None = None) -> PlanReport | None:
    """Fill ``verify_plan`` and ``write_plan`` in place for one forward step.

    Writes every array of ``verify_plan`` (slots, expected tokens and positions, predecessor
    slots, ``verify_num_valid``, ``verify_enable``) and of ``write_plan`` (``write_offsets``,
    ``write_seed_slot_indices``, ``write_num_valid_reqs``), nothing else. A call that raises
    leaves both plans as they were.

    Arrays of one library run there (numpy: the reference; cupy: the CUDA kernels on the
    current stream, no allocation, no host synchronisation, so a step can be captured in a
    CUDA graph after one eager run).

    Parameters
    ----------
    req_pool_indices, prefix_lens, extend_seq_lens : int64 ``[bs]``
        Per batch row: the request's table row (row 0 is padding and contributes nothing),
        the tokens already cached (which verify checks) and the tokens this step writes.
    req_to_token : int32 or int64 ``[rows, max_len]``, optional
        The slot of each request row and position. Exactly one of ``req_to_token`` and
        ``block_table`` is given.
    verify_plan : VerifyPlan
        Filled in place. More entries than ``verify_plan.verify_capacity`` disable the verify
        (``enable = 0``) instead of overflowing; see ``strict`` and ``check_capacity``.
    write_plan : WritePlan
        Filled in place; ``bs`` above ``write_plan.write_req_capacity`` is an error.
    swa_window_size : int, default 0
        Above 0, only the last ``swa_window_size`` prefix positions are verified and every
        slot goes through ``full_to_swa_index_mapping`` (int64 ``[full slots]``, then needed).
    full_to_swa_index_mapping : int64 ``[full slots]``, optional
    req_to_verify_expected_tokens : int32 or int64 ``[rows, max_len]``, optional
        With ``req_to_verify_expected_tokens_valid_lens`` (int64 ``[bs]``): each verified
        entry's expected token, read at ``position + kv_token_id_vs_position_offset``.
    req_to_verify_expected_tokens_valid_lens : int64 ``[bs]``, optional
    kv_token_id_vs_position_offset : int, default 0
    block_table : int32 or int64 ``[rows, max_blocks]``, optional
        With ``block_size >= 1``: position ``p`` of a row is slot ``block_table[row, p //
        block_size] * block_size + p % block_size``; block 0 is the null block, its
        positions map to padding slot 0.
    block_size : int, optional
        Tokens per block; given with ``block_table`` only.
    backend : {"auto", "numpy", "cupy"}, optional
        Forces a backend (``"auto"``: cupy when a CUDA device is usable, else numpy),
        copying the arrays over and the outputs back. By default the arrays' library.
    strict : bool, default False
        A verify plan too small for the batch raises (after the plan is filled) instead of
        warning :class:`VerifyPlanTooSmall` once per plan object.
    check_capacity : bool, optional
        Whether to compare the batch's prefix entries with the plan's capacity, which reads
        ``prefix_lens`` and ``req_pool_indices`` on the host. By default it runs for host
        (numpy) arrays, and for device arrays only with ``strict=True``: there it is a copy
        and a synchronisation per step, which a CUDA graph cannot capture (size the plan
        once with :func:`entries_needed`, or run a first step with the check on).
        ``False`` skips it everywhere.

    Returns
    -------
    PlanReport or None
        The entries needed against the capacity; None when the capacity check was skipped.

    Raises
    ------
    ValueError
        A :class:`~kvcanary.CanaryError` naming the argument at fault: a bad shape, dtype or
        library, both or neither table, ``bs`` above the write capacity, arrays that share
        memory with one the launch writes (both named), or with ``strict`` a plan too small
        for the batch.

    Examples
    --------
    >>> import numpy as np, kvcanary as kc
    >>> vp, wp = kc.VerifyPlan.allocate(64), kc.WritePlan.allocate(4)
    >>> table = np.arange(1, 33, dtype=np.int32).reshape(2, 16)
    >>> report = kc.plan(req_pool_indices=np.array([1], np.int64),
    ...     prefix_lens=np.array([3], np.int64), extend_seq_lens=np.array([2], np.int64),
    ...     req_to_token=table, verify_plan=vp, write_plan=wp)
    >>> report.enabled, int(vp.verify_num_valid[0]), vp.verify_slot_indices[:3].tolist()
    (True, 3, [17, 18, 19])
    """
    table_name, inputs, scalars, addresses = _plan_inputs(
        req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
        extend_seq_lens=extend_seq_lens, req_to_token=req_to_token, block_table=block_table,
        block_size=block_size, swa_window_size=swa_window_size,
        full_to_swa_index_mapping=full_to_swa_index_mapping,
        req_to_verify_expected_tokens=req_to_verify_expected_tokens,
        req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
    rows = inputs["req_pool_indices"]
    bs = rows.shape[0]
    verify_plan.validate()
    write_plan.validate()
    if bs > write_plan.write_req_capacity:
        raise CanaryError(f"bs={bs} exceeds write_req_capacity={write_plan.write_req_capacity}",
                          key="bs")
    library = _plan_library(table_name, inputs, verify_plan, write_plan)
    # Both plans are written, the batch only read (library first: two libraries' addresses
    # are two address spaces).
    fresh = inputs if table_name == "req_to_token" else {
        (table_name if name == "req_to_token" else name): array for name, array in inputs.items()}
    overlap.check_fresh(overlap.check_pair(verify_plan.extents(), write_plan.extents(), True,
                                           "plan"), fresh, "plan", library, addresses)
    if check_capacity is None:
        check_capacity = library == "numpy" or strict
    # Counted before the launch: a count past int64 is an error, raised with the plans as
    # they were.
    needed = entries_needed(rows, inputs["prefix_lens"], scalars["swa_window_size"]) \
        if check_capacity else None
    _run(backend or library, library, "plan",
         dict(inputs, verify_plan=verify_plan, write_plan=write_plan, **scalars))
    if not check_capacity:
        return None
    report = PlanReport(needed, verify_plan.verify_capacity, bs)
    if not report.enabled:
        _too_small(report, verify_plan, strict)
    return report


def _plan_inputs(*, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, block_table,
                 block_size, swa_window_size, full_to_swa_index_mapping,
                 req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
                 kv_token_id_vs_position_offset) -> tuple:
    """:func:`plan`'s batch arguments checked, in upstream's order: ``(table_name, inputs,
    scalars, addresses)``, the arrays by their launch names (the slot table as
    ``req_to_token``), the scalar arguments (``swa_window_size``,
    ``kv_token_id_vs_position_offset``, ``block_size``: 1 for a ``req_to_token`` table) and
    the data address of each array checked, by the name its errors use (the table's own)."""
    table_name, table, block_size = _slot_table(req_to_token, block_table, block_size)
    swa_window_size = A.check_int64(swa_window_size, "swa_window_size")
    kv_token_id_vs_position_offset = A.check_int64(kv_token_id_vs_position_offset,
                                                   "kv_token_id_vs_position_offset")
    if swa_window_size > 0 and full_to_swa_index_mapping is None:
        raise CanaryError(
            "launch_canary_plan_kernels requires full_to_swa_index_mapping when "
            "swa_window_size > 0", key="full_to_swa_index_mapping"
        )
    inputs = {
        "req_pool_indices": A.as_array(req_pool_indices, "req_pool_indices"),
        "prefix_lens": A.as_array(prefix_lens, "prefix_lens"),
        "extend_seq_lens": A.as_array(extend_seq_lens, "extend_seq_lens"),
        "req_to_token": table,
        "full_to_swa_index_mapping": A.as_array(full_to_swa_index_mapping,
                                                "full_to_swa_index_mapping"),
        "req_to_verify_expected_tokens": A.as_array(req_to_verify_expected_tokens,
                                                    "req_to_verify_expected_tokens"),
        "req_to_verify_expected_tokens_valid_lens": A.as_array(
            req_to_verify_expected_tokens_valid_lens, "req_to_verify_expected_tokens_valid_lens"),
    }
    rows = inputs["req_pool_indices"]
    addresses = {"req_pool_indices": A.check_array(rows, "req_pool_indices", A.INT64, 1)}
    bs = rows.shape[0]
    addresses["prefix_lens"] = A.check_array(inputs["prefix_lens"], "prefix_lens", A.INT64, 1, bs)
    addresses["extend_seq_lens"] = A.check_array(inputs["extend_seq_lens"], "extend_seq_lens",
                                                 A.INT64, 1, bs)
    addresses[table_name] = A.check_array(table, table_name, _TABLE_DTYPES, 2)
    lut = inputs["full_to_swa_index_mapping"]
    if lut is not None:
        addresses["full_to_swa_index_mapping"] = A.check_array(
            lut, "full_to_swa_index_mapping", A.INT64, 1)
    pool = inputs["req_to_verify_expected_tokens"]
    valid_lens = inputs["req_to_verify_expected_tokens_valid_lens"]
    if pool is not None:
        if valid_lens is None:
            raise CanaryError(
                "launch_canary_plan_kernels requires "
                "req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set",
                key="req_to_verify_expected_tokens_valid_lens"
            )
        addresses["req_to_verify_expected_tokens"] = A.check_array(
            pool, "req_to_verify_expected_tokens", _TABLE_DTYPES, 2)
    if valid_lens is not None:
        addresses["req_to_verify_expected_tokens_valid_lens"] = A.check_array(
            valid_lens, "req_to_verify_expected_tokens_valid_lens", A.INT64, 1, bs)
    scalars = dict(swa_window_size=swa_window_size,
                   kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
                   block_size=block_size)
    return table_name, inputs, scalars, addresses


def _plan_library(table_name: str, inputs: dict, verify_plan: VerifyPlan,
                  write_plan: WritePlan) -> str:
    """Both plans writeable (a read-only one is refused, never written), then every array of
    the launch of the table's library, which is returned. Plans that passed ``validate`` know
    whether all their arrays are writeable and of one library: then only the batch's arrays
    are compared, and any error is the one the full checks give."""
    library = A.library_of(inputs["req_to_token"])
    batch = {k: v for k, v in inputs.items() if k != "req_to_token"}
    if verify_plan.writeable() and write_plan.writeable() \
            and verify_plan.library() == write_plan.library() == library:
        return A.same_library(table_name, inputs["req_to_token"], **batch)
    outputs = {**verify_plan.arrays(), **write_plan.arrays()}
    for name, array in outputs.items():
        A.check_writeable(array, name)
    return A.same_library(table_name, inputs["req_to_token"], **batch, **outputs)


# The verify plans already warned too small: once per plan object, without writing onto it.
_WARNED_TOO_SMALL = weakref.WeakSet()


def _too_small(report: PlanReport, verify_plan: VerifyPlan, strict: bool) -> None:
    """A plan too small for its batch: raise with ``strict``, else warn once per plan."""
    message = (f"the verify plan holds {report.verify_capacity} entries but "
               f"the batch has {report.entries_needed} prefix entries: this step is not "
               f"verified (enable = 0); allocate VerifyPlan.allocate(n) with n >= "
               f"{report.entries_needed}")
    if strict:
        raise CanaryError(message, key="verify_plan")
    if verify_plan not in _WARNED_TOO_SMALL:
        _WARNED_TOO_SMALL.add(verify_plan)
        warnings.warn(VerifyPlanTooSmall(message), stacklevel=3)


def _slot_table(req_to_token, block_table, block_size) -> tuple:
    """``(name, table, block_size)`` from exactly one of the two table arguments."""
    if (req_to_token is None) == (block_table is None):
        given = "both" if block_table is not None else "neither"
        raise CanaryError(f"plan needs exactly one of req_to_token or block_table, "
                          f"got {given}")
    if block_table is None:
        if block_size is not None:
            raise CanaryError("block_size goes with block_table, not req_to_token",
                              key="block_size")
        return "req_to_token", A.as_array(req_to_token, "req_to_token"), 1
    if block_size is None:
        raise CanaryError("block_table needs block_size (tokens per block, >= 1)", key="block_size")
    block_size = A.check_int64(block_size, "block_size")
    if block_size < 1:
        raise CanaryError(f"block_size must be >= 1, got {block_size}", key="block_size")
    return "block_table", A.as_array(block_table, "block_table"), block_size


def write(context: CanaryContext, plan: WritePlan, *, input_ids, positions, out_cache_loc,
          expected_input_tokens=None, expected_input_positions=None,
          backend: str | None = None) -> None:
    """Stamp the canary records of this step's new tokens into ``context.canary_buf``.

    ``input_ids``, ``positions`` and ``out_cache_loc`` are int64 ``[num_tokens]``: the step's
    tokens, their positions and the slot each is written to, request after request as
    ``plan.write_offsets`` (from :func:`plan`) splits them. Each record holds the token, its
    position, the chain link to the request's previous record (from the seed slot, or the
    chain anchor at position 0) and, per ``context.real_kv_sources``, a hash of the slot's real
    KV bytes (``context.real_kv_hash_mode``: none, partial, all). With
    ``expected_input_tokens`` and ``expected_input_positions`` (int64 ``[num_tokens]``, both
    or neither) each token is also checked against them.

    Written in place: the records at ``out_cache_loc`` in ``context.canary_buf`` (uint8
    ``[slots, CANARY_SLOT_BYTES]``), the context's counters, and a row in
    ``context.violation_log`` for every broken rule (a slot out of range, a seed out of
    range, a chain position assert, a conflicting write); those are reported, not raised.
    Streams, graphs and backends as in :func:`plan`.

    >>> import numpy as np, kvcanary as kc
    >>> ctx = kc.CanaryContext(np.zeros((16, kc.CANARY_SLOT_BYTES), np.uint8),
    ...     kernel_kind=kc.LaunchTag.TAIL_K_FULL, violation_log=kc.ViolationLog.allocate(8),
    ...     slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64))
    >>> vp, wp = kc.VerifyPlan.allocate(8), kc.WritePlan.allocate(1)
    >>> table = np.zeros((2, 8), np.int32)
    >>> table[1] = np.arange(1, 9)        # request row 1: positions 0..7 in slots 1..8
    >>> kc.plan(req_pool_indices=np.array([1], np.int64), prefix_lens=np.array([0], np.int64),
    ...         extend_seq_lens=np.array([3], np.int64), req_to_token=table,
    ...         verify_plan=vp, write_plan=wp)
    PlanReport(entries_needed=0, verify_capacity=8, write_requests=1)
    >>> kc.write(ctx, wp, input_ids=np.array([7, 8, 9], np.int64),
    ...          positions=np.arange(3, dtype=np.int64), out_cache_loc=np.array([1, 2, 3]))
    >>> ctx.violation_log.total      # then verify the next step's prefix: slots 1, 2, 3
    0
    """
    context.validate_sources()
    tokens = {
        "input_ids": A.as_array(input_ids, "input_ids"),
        "positions": A.as_array(positions, "positions"),
        "out_cache_loc": A.as_array(out_cache_loc, "out_cache_loc"),
    }
    expected = {
        "expected_input_tokens": A.as_array(expected_input_tokens, "expected_input_tokens"),
        "expected_input_positions": A.as_array(expected_input_positions,
                                               "expected_input_positions"),
    }
    A.check_contiguous(context.canary_buf, "canary_buf")
    plan.validate()
    length = tokens["input_ids"].shape[0] if tokens["input_ids"].ndim == 1 else None
    addresses = {name: _check_token_array(array, name, length) for name, array in tokens.items()}
    given = [array is not None for array in expected.values()]
    if any(given) and not all(given):
        raise CanaryError(
            "expected input tensors are required when enable_write_input_assert=True"
        )
    if all(given):
        for name, array in expected.items():
            addresses[name] = _check_token_array(array, name, length)
    context.validate_arrays()
    A.check_writeable(context.canary_buf, "canary_buf")
    _check_tokens_cover_the_plan(plan, length)
    library = _same_library(context, plan, **tokens, **expected)
    written = overlap.check_pair(context.written_extents(), plan.extents(), False, "write")
    overlap.check_fresh(written, tokens, "write", library, addresses)
    overlap.check_fresh(written, expected, "write", library, addresses)
    _run(backend or library, library, "write",
         dict(context=context, plan=plan, **tokens, **expected))


def _check_tokens_cover_the_plan(plan: WritePlan, length: int) -> None:
    """A plan as :func:`plan` makes it (offsets from 0, never decreasing) that covers more
    tokens than the token arrays hold is the caller's shape mistake: an error naming the
    arrays. A corrupt plan (negative or decreasing offsets) is left to the launch, which
    reports every request it cannot write as a ``slot_out_of_range`` row, the way it treats
    any out-of-range index; so is a device plan, which a launch does not read back (it copies
    nothing to the host)."""
    if plan.library() != "numpy":
        return
    active = max(0, min(int(plan.write_num_valid_reqs[0]), plan.write_req_capacity))
    offsets = plan.write_offsets[: active + 1]
    if (active and int(offsets[-1]) > length and int(offsets[0]) == 0
            and bool((offsets[1:] >= offsets[:-1]).all())):
        raise CanaryError(
            f"input_ids, positions and out_cache_loc have {length} entries but the "
            f"write plan covers {int(offsets[-1])} tokens (write_offsets[{active}], "
            f"write_num_valid_reqs = {active}): pass one entry per planned token")


def verify(context: CanaryContext, plan: VerifyPlan, *, check_expected_token: bool = False,
           backend: str | None = None) -> None:
    """Check every prefix slot ``plan`` lists against its canary record.

    For each of the first ``plan.verify_num_valid`` entries (when ``plan.verify_enable``):
    the record's position must be the expected position, its chain link must match its
    predecessor's record (skipped at a chain head and where the predecessor is unreachable),
    its real-KV hash must match the slot's bytes, and with ``check_expected_token`` its token
    must be the expected one. Slot 0 is padding and is skipped. Every mismatch becomes one
    row of ``context.violation_log`` (int64 ``[8]``: kernel kind, slot, position, stored and
    expected token, stored chain hash, expected aux, fail-reason bits, see
    :class:`~kvcanary.FailReason`); the ring never wraps and its index counts dropped rows.

    Written in place: ``context.violation_log`` and the context's run counters; the canary
    records are only read. Streams, graphs and backends as in :func:`plan`.

    >>> import numpy as np, kvcanary as kc
    >>> ctx = kc.CanaryContext(np.zeros((16, kc.CANARY_SLOT_BYTES), np.uint8),
    ...     kernel_kind=kc.LaunchTag.TAIL_K_FULL, violation_log=kc.ViolationLog.allocate(8),
    ...     slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64))
    >>> kc.verify(ctx, kc.VerifyPlan.allocate(8))     # an empty plan checks nothing
    >>> ctx.violation_log.total
    0
    """
    context.validate_sources()
    A.check_contiguous(context.canary_buf, "canary_buf")
    plan.validate()
    context.validate_arrays()
    library = _same_library(context, plan)
    overlap.check_pair(context.written_extents(), plan.extents(), False, "verify")
    _run(backend or library, library, "verify",
         dict(context=context, plan=plan, check_expected_token=bool(check_expected_token)))


def _same_library(context: CanaryContext, plan, **arrays) -> str:
    """``arrays``, the plan's and the context's arrays all of canary_buf's library. A plan
    and context that passed ``validate`` know whether theirs are all of one library: then
    only ``arrays`` are compared, and any mismatch is the one the full comparison names."""
    library = A.library_of(context.canary_buf)
    if plan.library() == library == context.library():
        return A.same_library("canary_buf", context.canary_buf, **arrays)
    others = A.context_arrays(context)
    buf = others.pop("canary_buf")
    return A.same_library("canary_buf", buf, **arrays, **plan.arrays(), **others)


def _run(chosen: str, library: str, launch: str, kwargs: dict) -> None:
    """Run ``launch`` on ``chosen``'s backend; when the arrays live in the other library,
    copy them over and copy back what changed (outputs are updated in place)."""
    run = getattr(_backend_module(chosen), launch)
    if chosen == library:
        run(**kwargs)
        return
    from .transfer import moved

    with moved(kwargs, chosen) as moved_kwargs:
        run(**moved_kwargs)
