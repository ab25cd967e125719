"""The guard under transformers' long-running manager (init_continuous_batching, add_request,
request_id_iter / get_result, cancel_request, stop): findings arrive on the manager's thread
while it runs, a request cancelled in flight leaves no false alarm, what the guard keeps per
finished request is dropped, and a request can be aborted on a finding."""

from __future__ import annotations

import random
import threading
import time

import pytest

import skip_reasons

torch = pytest.importorskip("torch", reason=skip_reasons.transformers_extra("torch"))
transformers = pytest.importorskip(
    "transformers", reason=skip_reasons.transformers_extra("transformers"))

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from kvcanary.integrations import transformers as kvt  # noqa: E402
from kvcanary.integrations.transformers import manager as kvm  # noqa: E402
from kvcanary.integrations.transformers.drills import DrillSet, parse_drill  # noqa: E402

if not kvt.supported_version(transformers.__version__):
    pytest.skip(f"transformers {transformers.__version__} is outside the supported range",
                allow_module_level=True)

PAGE, VOCAB = 8, 128


@pytest.fixture(scope="module")
def model():
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def prompts(count, seed=0):
    r = random.Random(seed)
    prefix = [r.randrange(1, VOCAB) for _ in range(20)]
    return [prefix + [r.randrange(1, VOCAB) for _ in range(r.randrange(4, 30))]
            for _ in range(count)]


def start(model, num_blocks=48):
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(max_new_tokens=8, do_sample=False,
                                           eos_token_id=-1, pad_token_id=0),
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=64,
            max_requests_per_batch=8, use_async_batching=False))
    manager.start()
    return manager


def drain(manager, ids, timeout=60):
    results, deadline = {}, time.monotonic() + timeout
    while len(results) < len(ids) and time.monotonic() < deadline:
        out = manager.get_result(timeout=0.5)
        if out is not None and out.is_finished():
            results[out.request_id] = out
    return results


def test_manager_clean_with_cancels_and_bounded_memory(model):
    seen_threads = []
    guard = kvt.guard(model, sources="kv-all", on_violation=lambda f: seen_threads.append(f))
    with guard:
        manager = start(model)
        try:
            first = [manager.add_request(p, max_new_tokens=8) for p in prompts(24)]
            for rid in first[::5]:          # cancelled queued or in flight
                manager.cancel_request(rid)
            kept = [rid for i, rid in enumerate(first) if i % 5]
            # One request read through request_id_iter while the others run.
            one = manager.add_request(prompts(1, seed=9)[0], max_new_tokens=6, streaming=True)
            streamed = list(manager.request_id_iter(one))
            assert streamed[-1].is_finished() and len(streamed[-1].generated_tokens) == 6
            results = drain(manager, kept)
            assert set(results) == set(kept)
            assert all(r.error is None and len(r.generated_tokens) == 8 for r in results.values())
            session = guard.session.groups[0]
            for wave in range(1, 4):        # many finished requests: nothing per request stays
                ids = [manager.add_request(p, max_new_tokens=4) for p in prompts(16, wave)]
                drain(manager, ids)
            time.sleep(0.3)
            assert len(session.requests) <= 8 and len(session.uid_of) <= 8
            assert len(session.request_names) <= session.num_slots + kvm._NAMES_SLACK + 8
        finally:
            manager.stop(block=True, timeout=10)
    assert seen_threads == [], [f.describe() for f in seen_threads[:3]]
    s = guard.summary()
    assert s["findings"] == 0 and s["steps"] > 20 and s["ring_rows"] == 0


def test_names_table_is_compacted(model, monkeypatch):
    monkeypatch.setattr(kvm, "_NAMES_SLACK", 4)
    guard = kvt.guard(model, on_violation=lambda f: None)
    with guard:
        manager = start(model)
        try:
            for wave in range(3):
                drain(manager, [manager.add_request(p, max_new_tokens=3)
                                for p in prompts(12, wave)])
            time.sleep(0.3)
            session = guard.session.groups[0]
            assert len(session.request_names) <= len(session.uid_of) + session.num_slots + 4
            assert set(session.writer_request[session.writer_request >= 0].tolist()) <= \
                set(range(len(session.request_names)))
        finally:
            manager.stop(block=True, timeout=10)
    assert guard.summary()["findings"] == 0


def test_findings_arrive_on_the_manager_thread_and_abort_fails_only_that_request(model):
    drills = DrillSet([parse_drill("remap@4")])
    seen = []
    main = threading.get_ident()

    def on_finding(finding):
        seen.append((threading.get_ident(), finding))
        kvm.abort_request(guard, finding.request_id, f"kvcanary: {finding.reasons[0]}")

    guard = kvt.guard(model, on_violation=on_finding)
    with guard:
        drills.install()
        manager = start(model)
        try:
            ids = [manager.add_request(p, max_new_tokens=12) for p in prompts(16)]
            first = None
            deadline = time.monotonic() + 30
            while not seen and time.monotonic() < deadline:   # arrives while it runs
                time.sleep(0.01)
            first = seen[0][1] if seen else None
            results = drain(manager, ids)
        finally:
            manager.stop(block=True, timeout=10)
            drills.uninstall()
    (drill,) = drills.fired
    assert first is not None and all(thread != main for thread, _ in seen)
    assert first.request_id == drill.request_id and first.first_step >= drill.fired_step
    assert drill.position <= first.position < drill.position + PAGE
    assert "remapped" in first.explanation
    failed = {rid for rid, r in results.items() if r.error is not None}
    assert failed == {drill.request_id}, failed
    assert "kvcanary" in results[drill.request_id].error
    assert all(len(r.generated_tokens) == 12 for rid, r in results.items() if rid not in failed)


@pytest.mark.parametrize("kind", ["free-held", "kv-flip", "position-shift"])
def test_each_drill_is_found_at_its_request_and_position(model, kind, caplog):
    drills = DrillSet([parse_drill(f"{kind}@3")])
    guard = kvt.guard(model, on_violation="log")        # the logger, on the manager's thread
    with guard:
        drills.install()
        manager = start(model, num_blocks=40)
        try:
            drain(manager, [manager.add_request(p, max_new_tokens=12) for p in prompts(16)])
        finally:
            manager.stop(block=True, timeout=10)
            drills.uninstall()
    (drill,) = drills.fired
    mine = [f for f in guard.findings() if f.request_id == drill.request_id]
    logged = [r for r in caplog.records if r.name == "kvcanary" and r.levelname == "WARNING"
              and f"request={drill.request_id} " in r.getMessage()]
    assert logged and all(r.threadName != "MainThread" for r in logged)
    assert mine, (drill, [f.describe() for f in guard.findings()[:3]])
    if kind == "free-held":
        # The cause is named when another request reused the block ("freed ... reused"); one
        # handed back to the same request gets the facts only (whose record the slot holds).
        assert any(f.block == drill.block and ("freed" in f.explanation or
                                               "record of position" in f.explanation)
                   for f in mine), [f.describe() for f in mine[:3]]
    else:
        assert any(f.position == drill.position for f in mine), [f.describe() for f in mine]


def test_bad_drill_names_the_drill():
    for bad in ("remap", "melt@3", "kv-flip@0", "kv-flip@x"):
        with pytest.raises(kvt.GuardError, match="drill"):
            parse_drill(bad)
