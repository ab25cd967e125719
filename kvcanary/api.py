"""The three launches of the public API: ``plan``, ``write``, ``verify``.

Each checks its arguments (upstream's messages, in upstream's order), then dispatches by
array library: numpy arrays run the numpy reference, cupy arrays the CUDA kernels.
``backend=`` forces one; arrays of the other library are then copied over and the
outputs copied back, so the call still works in place."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from . import arrays as A
from .consts import REQ_POOL_IDX_PADDING
from .reference.plan import window_start
from .types import CanaryContext, VerifyPlan, WritePlan, to_host

_INT64 = (np.int64,)
_TABLE_DTYPES = (np.int32, np.int64)
BACKENDS = ("numpy", "cupy")


def _backend_module(name: str):
    """A module with ``plan``, ``write`` and ``verify`` taking validated arguments."""
    if name == "numpy":
        from . import reference

        return reference.BACKEND
    if name == "cupy":
        from . import cuda

        return cuda.backend()
    raise ValueError(f"kv-canary: backend must be one of {', '.join(BACKENDS)} or None, got {name!r}")


def _check_token_array(x, name: str, length: int | None) -> None:
    A.check_array(x, name, _INT64, 1, length)


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
    return int(np.where(rows != REQ_POOL_IDX_PADDING, np.maximum(0, lens - start), 0).sum())


def plan(*, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token=None,
         verify_plan: VerifyPlan, write_plan: WritePlan, swa_window_size: int = 0,
         full_to_swa_index_mapping=None, req_to_verify_expected_tokens=None,
         req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset: int = 0,
         block_table=None, block_size=None, backend: str | None = None,
         strict: bool = False, check_capacity: bool = True) -> PlanReport | None:
    """Fill ``verify_plan`` and ``write_plan`` in place for one forward step (docs/format.md §7).

    Returns a :class:`PlanReport` (entries needed against the plan's capacity). A verify plan
    too small for the batch is never silent: :class:`VerifyPlanTooSmall` is warned once per
    plan object, or with ``strict=True`` a ``ValueError`` is raised after the plan is filled
    (it is disabled). The check copies ``prefix_lens`` and ``req_pool_indices`` to the host;
    ``check_capacity=False`` skips it (inside a CUDA graph capture) and returns None.

    Slots come from exactly one table: ``req_to_token`` (int32/int64 ``[rows, max_len]``, the
    slot of each request row and position), or ``block_table`` (int32/int64 ``[rows,
    max_blocks]``) with ``block_size >= 1``, where position ``p`` of a row is slot
    ``block_table[row, p // block_size] * block_size + p % block_size``. Block 0 is the null
    block: its positions map to padding slot 0. The plan is the one of the equivalent
    per-token table, without building it."""
    table_name, table, block_size = _slot_table(req_to_token, block_table, block_size)
    swa_window_size = A.check_int64(swa_window_size, "swa_window_size")
    kv_token_id_vs_position_offset = A.check_int64(kv_token_id_vs_position_offset,
                                                   "kv_token_id_vs_position_offset")
    if swa_window_size > 0 and full_to_swa_index_mapping is None:
        raise ValueError(
            "kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping when "
            "swa_window_size > 0"
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
    A.check_array(rows, "req_pool_indices", _INT64, 1)
    bs = rows.shape[0]
    A.check_array(inputs["prefix_lens"], "prefix_lens", _INT64, 1, bs)
    A.check_array(inputs["extend_seq_lens"], "extend_seq_lens", _INT64, 1, bs)
    A.check_array(table, table_name, _TABLE_DTYPES, 2)
    lut = inputs["full_to_swa_index_mapping"]
    if lut is not None:
        A.check_array(lut, "full_to_swa_index_mapping", _INT64, 1)
    pool = inputs["req_to_verify_expected_tokens"]
    valid_lens = inputs["req_to_verify_expected_tokens_valid_lens"]
    if pool is not None:
        if valid_lens is None:
            raise ValueError(
                "kv-canary: launch_canary_plan_kernels requires "
                "req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set"
            )
        A.check_array(pool, "req_to_verify_expected_tokens", _TABLE_DTYPES, 2)
        A.check_array(valid_lens, "req_to_verify_expected_tokens_valid_lens", _INT64, 1, bs)
    elif valid_lens is not None:
        A.check_array(valid_lens, "req_to_verify_expected_tokens_valid_lens", _INT64, 1, bs)
    verify_plan.validate()
    write_plan.validate()
    if bs > write_plan.write_req_capacity:
        raise ValueError(f"kv-canary: bs={bs} exceeds write_req_capacity={write_plan.write_req_capacity}")
    outputs = {**verify_plan.arrays(), **write_plan.arrays()}
    for name, array in outputs.items():
        A.check_writeable(array, name)
    library = A.same_library(table_name, table,
                             **{k: v for k, v in inputs.items() if k != "req_to_token"}, **outputs)
    kwargs = dict(inputs, verify_plan=verify_plan, write_plan=write_plan,
                  swa_window_size=swa_window_size,
                  kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
    kwargs["block_size"] = block_size
    _run(backend or library, library, "plan", kwargs)
    if not check_capacity:
        return None
    report = PlanReport(entries_needed(rows, inputs["prefix_lens"], swa_window_size),
                        verify_plan.verify_capacity, bs)
    if not report.enabled:
        message = (f"kv-canary: the verify plan holds {report.verify_capacity} entries but "
                   f"the batch has {report.entries_needed} prefix entries: this step is not "
                   f"verified (enable = 0); allocate VerifyPlan.allocate(n) with n >= "
                   f"{report.entries_needed}")
        if strict:
            raise ValueError(message)
        if not getattr(verify_plan, "_warned_too_small", False):
            verify_plan._warned_too_small = True
            warnings.warn(VerifyPlanTooSmall(message.removeprefix("kv-canary: ")), stacklevel=2)
    return report


def _slot_table(req_to_token, block_table, block_size) -> tuple:
    """``(name, table, block_size)`` from exactly one of the two table arguments."""
    if (req_to_token is None) == (block_table is None):
        given = "both" if block_table is not None else "neither"
        raise ValueError(f"kv-canary: plan needs exactly one of req_to_token or block_table, "
                         f"got {given}")
    if block_table is None:
        if block_size is not None:
            raise ValueError("kv-canary: block_size goes with block_table, not req_to_token")
        return "req_to_token", A.as_array(req_to_token, "req_to_token"), 1
    if block_size is None:
        raise ValueError("kv-canary: block_table needs block_size (tokens per block, >= 1)")
    block_size = A.check_int64(block_size, "block_size")
    if block_size < 1:
        raise ValueError(f"kv-canary: block_size must be >= 1, got {block_size}")
    return "block_table", A.as_array(block_table, "block_table"), block_size


def write(context: CanaryContext, plan: WritePlan, *, input_ids, positions, out_cache_loc,
          expected_input_tokens=None, expected_input_positions=None,
          backend: str | None = None) -> None:
    """Stamp the canary records of this step's new tokens (docs/format.md §8)."""
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
    for name, array in tokens.items():
        _check_token_array(array, name, length)
    given = [array is not None for array in expected.values()]
    if any(given) and not all(given):
        raise ValueError(
            "kv-canary: expected input tensors are required when enable_write_input_assert=True"
        )
    if all(given):
        for name, array in expected.items():
            _check_token_array(array, name, length)
    context.validate()
    A.check_writeable(context.canary_buf, "canary_buf")
    _check_tokens_cover_the_plan(plan, length)
    library = _same_library(context, plan, **tokens, **expected)
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
        raise ValueError(
            f"kv-canary: input_ids, positions and out_cache_loc have {length} entries but the "
            f"write plan covers {int(offsets[-1])} tokens (write_offsets[{active}], "
            f"write_num_valid_reqs = {active}): pass one entry per planned token")


def verify(context: CanaryContext, plan: VerifyPlan, *, check_expected_token: bool = False,
           backend: str | None = None) -> None:
    """Check every planned prefix slot; violations go to the context's ring (docs/format.md §9)."""
    context.validate_sources()
    A.check_contiguous(context.canary_buf, "canary_buf")
    plan.validate()
    context.validate()
    library = _same_library(context, plan)
    _run(backend or library, library, "verify",
         dict(context=context, plan=plan, check_expected_token=bool(check_expected_token)))


def _same_library(context: CanaryContext, plan, **arrays) -> str:
    """``arrays``, the plan's and the context's arrays all of canary_buf's library. A plan
    and context that passed ``validate`` know whether theirs are all of one library: then
    only ``arrays`` are compared, and any mismatch is the one the full comparison names."""
    library = A.library_of(context.canary_buf)
    if plan.library() == library == context.library():
        return A.same_library("canary_buf", context.canary_buf, **arrays)
    return A.same_library("canary_buf", context.canary_buf, **arrays, **plan.arrays(),
                          **_context_arrays(context))


def _context_arrays(context: CanaryContext) -> dict:
    arrays = {
        "violation_ring": context.violation_log.ring,
        "violation_write_index": context.violation_log.write_index,
        "slot_run_counter": context.slot_run_counter,
        "kernel_run_counter": context.kernel_run_counter,
        "enable_chain_position_assert": context.enable_chain_position_assert,
    }
    for index, source in enumerate(context.real_kv_sources):
        arrays[f"real_kv_sources[{index}].tensor"] = source.tensor
    return arrays


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
