"""A launch after one that passed skips only the checks whose inputs did not change: every
array or source replaced, or changed in place (shape, dtype, strides, writeability, data),
is checked again and gives the error a first launch with it gives. (The cupy side runs in
tests/cupy_stub.py.)"""

import numpy as np
import pytest

import kvcanary as kc
from builders import i64, make_context, make_sources, make_verify_plan, make_write_plan


def objects():
    return (make_context(sources=make_sources(2, 32), mode=kc.RealKvHashMode.ALL),
            make_verify_plan([1, 2], [0, 1], [-1, 1], capacity=4),
            make_write_plan([2], [-1], capacity=2))


def launch(name, ctx, verify_plan, write_plan):
    if name == "verify":
        kc.verify(ctx, verify_plan)
    else:
        kc.write(ctx, write_plan, input_ids=i64([1, 2]), positions=i64([0, 1]),
                 out_cache_loc=i64([3, 4]))


def set_dtype(array, dtype):
    array.dtype = dtype  # numpy reinterprets the memory in place


def set_read_only(array):
    array.flags.writeable = False


def shift_data(array):
    array.resize(array.shape[0] + 64, refcheck=False)  # new memory, same object


CHANGES = {  # name: change to (context, verify plan, write plan)
    "verify plan dtype in place":
        lambda c, v, w: set_dtype(v.verify_slot_indices, np.int32),
    "verify plan array replaced":
        lambda c, v, w: setattr(v, "enable", np.ones(1, np.int64)),
    "write plan shape in place":
        lambda c, v, w: setattr(w.write_offsets, "shape", (1, 3)),
    "write plan array replaced":
        lambda c, v, w: setattr(w, "write_offsets", np.zeros(2, np.int64)),
    "write plan data moved": lambda c, v, w: shift_data(w.write_offsets),
    "canary buffer replaced":
        lambda c, v, w: setattr(c, "canary_buf", np.zeros((32, 24), np.uint8)),
    "ring read-only": lambda c, v, w: set_read_only(c.violation_log.ring),
    "counter read-only": lambda c, v, w: set_read_only(c.kernel_run_counter),
    "log replaced": lambda c, v, w: setattr(c, "violation_log", kc.ViolationLog(
        np.zeros((4, 7), np.int64), np.zeros(1, np.int32))),
    # (a source is immutable: another layout over the same tensor is a new source)
    "source layout changed": lambda c, v, w: setattr(c, "real_kv_sources", (
        c.real_kv_sources[0], kc.RealKvSource(
            c.real_kv_sources[1].tensor, page_size=2,
            num_bytes_per_token=c.real_kv_sources[1].num_bytes_per_token,
            read_bytes=c.real_kv_sources[1].read_bytes))),
    "source replaced": lambda c, v, w: setattr(c, "real_kv_sources", (  # rows too narrow
        c.real_kv_sources[0], kc.RealKvSource(np.zeros((32, 16), np.uint8), page_size=2,
                                              num_bytes_per_token=16, read_bytes=16))),
    "bound lowered": lambda c, v, w: setattr(c, "max_real_kv_sources", 1),
}


def first_error(launch_name, change):
    ctx, verify_plan, write_plan = objects()
    change(ctx, verify_plan, write_plan)
    with pytest.raises(Exception) as info:
        launch(launch_name, ctx, verify_plan, write_plan)
    return type(info.value), str(info.value)


# Each launch with the changes to what it takes (verify takes no write plan, write no verify
# plan): only those pairs are generated, so none is skipped.
PAIRS = [pytest.param(launch_name, change, id=f"{launch_name}-{name}")
         for launch_name, other in (("verify", "write plan"), ("write", "verify plan"))
         for name, change in CHANGES.items() if other not in name]


@pytest.mark.parametrize(("launch_name", "change"), PAIRS)
def test_changed_argument_is_checked_again(launch_name, change):
    expected = first_error(launch_name, change)
    ctx, verify_plan, write_plan = objects()
    launch(launch_name, ctx, verify_plan, write_plan)
    launch(launch_name, ctx, verify_plan, write_plan)  # the repeat that skips the checks
    change(ctx, verify_plan, write_plan)
    with pytest.raises(Exception) as info:
        launch(launch_name, ctx, verify_plan, write_plan)
    assert (type(info.value), str(info.value)) == expected


def test_unchanged_repeat_still_launches():
    ctx, verify_plan, write_plan = objects()
    for _ in range(3):
        launch("write", ctx, verify_plan, write_plan)
        launch("verify", ctx, verify_plan, write_plan)
    assert int(ctx.kernel_run_counter[0]) == 6


def test_unchanged_repeat_checks_only_the_step_arrays(monkeypatch):
    # What makes a decode-step call cheap: the plan's and context's arrays, unchanged since
    # they passed, are not checked again; the step's own token arrays always are.
    from kvcanary.model import arrays as A

    ctx, verify_plan, write_plan = objects()
    launch("write", ctx, verify_plan, write_plan)
    launch("verify", ctx, verify_plan, write_plan)
    checked = []
    real_check_array = A.check_array
    monkeypatch.setattr(A, "check_array", lambda x, name, *rest: (
        checked.append(name), real_check_array(x, name, *rest))[1])
    launch("write", ctx, verify_plan, write_plan)
    launch("verify", ctx, verify_plan, write_plan)
    assert checked == ["input_ids", "positions", "out_cache_loc"]
    write_plan.write_num_valid_reqs = np.ones(1, np.int32)
    launch("write", ctx, verify_plan, write_plan)
    assert "plan.write_num_valid_reqs" in checked


@pytest.mark.parametrize("launch_name", ["verify", "write"])
@pytest.mark.parametrize("field,value,key", [("read_bytes", 4096, "read_bytes"),
                                             ("num_bytes_per_token", 8, "num_bytes_per_token"),
                                             ("page_size", 0, "page_size")])
@pytest.mark.parametrize("repeat", [False, True])
def test_a_source_field_forced_past_its_immutability_is_checked_at_the_launch(
        launch_name, field, value, key, repeat):
    """``object.__setattr__`` still reaches a slotted field: the launch checks the layout it
    reads again (a read_bytes past the row let the kernels read past the tensor)."""
    ctx, verify_plan, write_plan = objects()
    if repeat:
        launch(launch_name, ctx, verify_plan, write_plan)
    object.__setattr__(ctx.real_kv_sources[1], field, value)
    with pytest.raises(kc.CanaryError, match=f"RealKvSource.{key} must be") as info:
        launch(launch_name, ctx, verify_plan, write_plan)
    assert info.value.key == key
