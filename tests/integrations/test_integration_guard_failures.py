"""The transformers guard refuses a ring it cannot use (at ``guard()``, naming the argument),
and a failure inside the guard itself never silently fails the engine's requests: the step
runs unguarded, the failure is logged, and ``generate_batch`` raises ``GuardError``."""

from __future__ import annotations

import logging

import pytest

import skip_reasons

torch = pytest.importorskip("torch", reason=skip_reasons.transformers_extra("torch"))
transformers = pytest.importorskip(
    "transformers", reason=skip_reasons.transformers_extra("transformers"))

from test_integration_transformers import batching, generation, make_model, prompts  # noqa: E402

from kvcanary.integrations import transformers as kvt  # noqa: E402
from kvcanary.integrations.transformers import session as session_module  # noqa: E402

if not kvt.supported_version(transformers.__version__):
    pytest.skip(f"transformers {transformers.__version__} is outside the supported range "
                f"{kvt.SUPPORTED_RANGE}", allow_module_level=True)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.mark.parametrize("capacity", [0, -1, 2**40, 2.5, True, "8"])
def test_a_ring_capacity_the_guard_cannot_use_is_refused_at_guard(model, capacity):
    with pytest.raises(kvt.GuardError, match=r"ring_capacity must be an integer from 1 to"):
        kvt.guard(model, ring_capacity=capacity)


@pytest.mark.parametrize("when", ["before_step", "after_step"])
def test_a_bug_in_the_guard_runs_the_step_unguarded_and_raises_guard_error(model, monkeypatch,
                                                                     caplog, when):
    def broken(self, processor):
        raise ZeroDivisionError("a bug in the guard")

    monkeypatch.setattr(session_module.Session, when, broken)
    guard = kvt.guard(model, on_violation=lambda f: None)
    with caplog.at_level(logging.ERROR, logger="kvcanary"), guard:
        with pytest.raises(kvt.GuardError, match=r"the guard failed .* \(ZeroDivisionError") as info:
            model.generate_batch(inputs=prompts(4), generation_config=generation(new_tokens=4),
                                 continuous_batching_config=batching())
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert any("ran unguarded" in r.getMessage() for r in caplog.records)
    # The engine itself was not failed: a second call, unbroken, generates normally.
    monkeypatch.undo()
    with kvt.guard(model, on_violation=lambda f: None) as second:
        outputs = model.generate_batch(inputs=prompts(4), generation_config=generation(new_tokens=4),
                                       continuous_batching_config=batching())
    assert len(outputs) == 4 and all(len(o.generated_tokens) == 4 for o in outputs.values())
    assert second.summary()["steps"] > 0


def test_leaving_a_guard_never_entered_is_a_guard_error(model):
    guard = kvt.guard(model)
    with pytest.raises(kvt.GuardError, match="never entered"):
        guard.__exit__(None, None, None)


def test_a_guard_that_saw_no_step_says_so(model, caplog):
    with caplog.at_level(logging.WARNING, logger="kvcanary"), kvt.guard(model):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
    assert any("saw no generate_batch step" in r.getMessage() for r in caplog.records)
