"""A verify plan too small for its batch is warned once per plan object, at the caller's
line, and nothing is written onto the plan to remember it; ``plan``'s docstring has the
numpydoc sections."""

import inspect
import warnings

import kvcanary as kc
from builders import i64, linear_req_to_token


def _too_small_step(vp, wp):
    return kc.plan(req_pool_indices=i64([1]), prefix_lens=i64([8]), extend_seq_lens=i64([1]),
                   req_to_token=linear_req_to_token(2, 16), verify_plan=vp, write_plan=wp)


def test_warned_once_per_plan_object_at_the_callers_line_and_the_plan_is_left_alone():
    first, second, wp = kc.VerifyPlan.allocate(4), kc.VerifyPlan.allocate(4), kc.WritePlan.allocate(2)
    fits = kc.VerifyPlan.allocate(64)
    _too_small_step(fits, wp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _too_small_step(first, wp)
        _too_small_step(second, wp)
    too_small = [w for w in caught if issubclass(w.category, kc.VerifyPlanTooSmall)]
    assert len(too_small) == 2
    assert all(w.filename == __file__ for w in too_small), [w.filename for w in too_small]
    # The warned plan holds what a plan that fits holds (its own caches), nothing more.
    assert set(vars(first)) == set(vars(fits))


def test_plan_documents_its_parameters_returns_raises_and_examples():
    doc = inspect.getdoc(kc.plan)
    for section in ("Parameters", "Returns", "Raises", "Examples"):
        assert f"\n{section}\n{'-' * len(section)}\n" in doc, section
    documented = {name.strip() for line in doc.splitlines() if " : " in line
                  and not line.startswith(" ") for name in line.split(" : ")[0].split(",")}
    assert documented == set(inspect.signature(kc.plan).parameters)
