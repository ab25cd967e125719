"""kvcanary.integrations.vllm on vLLM's real scheduler and KV cache manager (the official
wheel installed without its dependencies beside torch's CPU build; .ci/run does that in a
venv of its own), driven with fake model outputs (tests/integrations/vllm_engine.py).

Clean runs over seeded configurations give no finding; faults injected into vLLM's own
objects (its block pool, its prefix cache, its KV cache manager) are each found at the
request and position they hit, with the cause named."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (.ci/run installs it in a venv of "
                                   "its own; see docs/engines.md)")
import vllm_engine as ve  # noqa: E402

from kvcanary.findings.causes import Cause  # noqa: E402
from kvcanary.integrations import vllm as kvv  # noqa: E402

CONFIGS = [
    # (name, Config): prefix caching on/off, preemption (tight pools), eviction, chunked
    # prefill with small token budgets, a hybrid model with a sliding-window group.
    *[(f"roomy-{s}", ve.Config(seed=s, num_blocks=60)) for s in range(3)],
    *[(f"tight-{s}", ve.Config(seed=s, num_blocks=12, requests=14)) for s in range(3, 7)],
    *[(f"no-prefix-cache-{s}", ve.Config(seed=s, num_blocks=14, prefix_caching=False))
      for s in range(7, 10)],
    *[(f"chunked-{s}", ve.Config(seed=s, num_blocks=20, max_num_batched_tokens=32))
      for s in range(10, 13)],
    *[(f"no-chunking-{s}", ve.Config(seed=s, num_blocks=24, chunked_prefill=False,
                                     max_num_batched_tokens=2048)) for s in range(13, 15)],
    *[(f"sliding-{s}", ve.Config(seed=s, num_blocks=26, sliding_window=24, requests=10))
      for s in range(15, 19)],
    *[(f"eviction-{s}", ve.Config(seed=s, num_blocks=16, requests=20, shared_prefix=48,
                                  arrivals_per_step=1)) for s in range(19, 22)],
]


def _guarded(engine, max_steps=400):
    found = []
    g = kvv.guard(engine.scheduler, check_tokens=True, on_violation=found.append)
    with g:
        engine.run(max_steps)
    return g, found


@pytest.fixture(scope="module")
def tmp_model(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


def test_clean_configurations_have_no_finding(tmp_model):
    totals = dict(steps=0, preemptions=0, entries=0)
    for name, cfg in CONFIGS:
        engine = ve.Engine(cfg, tmp_model)
        g, found = _guarded(engine)
        assert not engine.scheduler.has_unfinished_requests(), name
        assert found == [] and g.findings() == [], (name, [f.describe() for f in found])
        totals["steps"] += engine.steps
        totals["preemptions"] += engine.preemptions
        totals["entries"] += g.summary()["entries_verified"]
    assert len(CONFIGS) >= 20
    assert totals["preemptions"] > 0 and totals["entries"] > 0


def test_without_chaining_same_step_hits_give_false_findings(tmp_model, monkeypatch):
    """The core's chaining across requests is what keeps same-step prefix hits clean."""
    from kvcanary.model import types

    init = types.CanaryContext.__init__
    monkeypatch.setattr(types.CanaryContext, "__init__", lambda self, *a, **k: init(
        self, *a, **dict(k, chain_across_requests=False)))
    false = 0
    for _, cfg in CONFIGS[:8]:
        false += len(_guarded(ve.Engine(cfg, tmp_model))[1])
    assert false > 0


def _run_until(engine, g, found, steps=200):
    with g:
        for _ in range(steps):
            if found or not (engine.pending or engine.scheduler.has_unfinished_requests()):
                break
            try:
                engine.step()
            except (AssertionError, ValueError, RuntimeError):
                break           # vLLM's own checks trip later on the injected fault
    for f in found:             # every cause is a member of the one vocabulary
        assert f.cause in Cause and f.explanation == f.diagnosis.text, f.describe()
    return found


def _running(engine, min_blocks=2):
    s = engine.scheduler
    pool = s.kv_cache_manager.block_pool
    for request in s.running:
        blocks = s.kv_cache_manager.get_blocks(request.request_id).blocks[0]
        full = request.num_computed_tokens // engine.cfg.block_size
        own = [b for b in blocks[:full] if b.ref_cnt == 1 and not b.is_null]
        if len(own) >= min_blocks:
            return request, own, pool
    return None, None, pool


def test_block_freed_while_referenced(tmp_model):
    engine = ve.Engine(ve.Config(seed=40, num_blocks=16, requests=14), tmp_model)
    found = []
    g = kvv.guard(engine.scheduler, on_violation=found.append)
    with g:
        while _running(engine)[0] is None:
            engine.step()
    victim, own, pool = _running(engine)
    block = own[-1]
    pool.free_blocks([block])             # the bug: freed while the request maps it
    _run_until(engine, g, found)
    assert found, "the freed block was not caught"
    f = found[0]
    assert f.request_id == victim.request_id and f.block == block.block_id
    assert f.position // engine.cfg.block_size == \
        engine.scheduler.kv_cache_manager.get_blocks(victim.request_id).blocks[0].index(block)
    assert "freed while still referenced" in f.explanation and f.cause is Cause.FREED_WHILE_HELD


def test_prefix_cache_hash_collision(tmp_model):
    engine = ve.Engine(ve.Config(seed=41, requests=0), tmp_model)
    found = []
    g = kvv.guard(engine.scheduler, on_violation=found.append)
    first = list(range(100, 150))
    engine.add("a", first, 4)
    with g:
        engine.run()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    other = list(range(300, 350))
    request = Request("b", other, SamplingParams(max_tokens=4, ignore_eos=True), None,
                      block_hasher=engine.hasher)
    a_hashes = Request("a2", first, SamplingParams(max_tokens=1), None,
                       block_hasher=engine.hasher).block_hashes
    request.block_hashes[0] = a_hashes[0]  # the bug: two prefixes, one block hash
    engine.scheduler.add_request(request)
    _run_until(engine, g, found)
    assert found
    f = found[0]
    assert (f.request_id, f.position) == ("b", 0)
    assert "verify_token" in f.reasons
    assert "hash collision" in f.explanation and "a's tokens" in f.explanation
    assert f.cause is Cause.PREFIX_COLLISION


def test_request_reading_the_null_block(tmp_model):
    engine = ve.Engine(ve.Config(seed=42, num_blocks=40, requests=4, prompt_range=(30, 40),
                                 output_range=(40, 50)), tmp_model)
    found = []
    g = kvv.guard(engine.scheduler, on_violation=found.append)
    pool = engine.scheduler.kv_cache_manager.block_pool
    original = pool.get_new_blocks
    armed = []

    def get_new_blocks(n):
        blocks = original(n)
        if armed and n == 1:
            armed.clear()
            blocks[0] = pool.null_block      # the bug: a new block is the null block
        return blocks

    pool.get_new_blocks = get_new_blocks
    with g:
        for _ in range(6):
            engine.step()
    armed.append(True)
    _run_until(engine, g, found)
    assert found
    f = found[0]
    assert f.slot == 0 and "slot_zero_in_prefix" in f.reasons
    assert f.position % engine.cfg.block_size == 0
    assert "null block" in f.explanation and f.cause is Cause.SLOT_ZERO


def test_evicted_cached_block_handed_out_while_mapped(tmp_model):
    engine = ve.Engine(ve.Config(seed=43, num_blocks=14, requests=0), tmp_model)
    found = []
    g = kvv.guard(engine.scheduler, on_violation=found.append)
    prompt = list(range(500, 540))
    engine.add("a", prompt, 2)
    with g:
        engine.run()
    pool = engine.scheduler.kv_cache_manager.block_pool
    touch = pool.touch
    pool.touch = lambda blocks: setattr(pool, "touch", touch)   # the bug: one touch lost
    engine.add("b", prompt + list(range(600, 640)), 40)
    engine.pending = [(f"c{i}", list(range(700 + 50 * i, 740 + 50 * i)), 20) for i in range(6)]
    _run_until(engine, g, found)
    assert found
    f = found[0]
    assert f.request_id == "b" and f.position < 32
    assert "evicted cached block" in f.explanation and f.cause is Cause.HANDED_TO_ANOTHER


def test_preempted_request_resumed_onto_wrong_blocks(tmp_model):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    engine = ve.Engine(ve.Config(seed=45, num_blocks=12, requests=14), tmp_model)
    found = []
    g = kvv.guard(engine.scheduler, on_violation=found.append)
    manager = engine.scheduler.kv_cache_manager
    original = manager.get_computed_blocks
    swapped = []

    def get_computed_blocks(request, *args, **kwargs):
        blocks, hit, *rest = original(request, *args, **kwargs)
        group = list(blocks.blocks[0])
        if request.num_preemptions and group and (not swapped or
                                                  swapped[0][0] == request.request_id):
            other = [b for b in manager.block_pool.blocks
                     if b.block_hash is not None and b not in group and not b.is_null
                     and (not swapped or b.block_id == swapped[0][2])]
            if other:       # the bug: the resumed request gets another prefix's block
                swapped[:] = [(request.request_id, group[0].block_id, other[0].block_id)]
                group[0] = other[0]
                blocks = KVCacheBlocks((group, *blocks.blocks[1:]))
        return (blocks, hit, *rest)

    manager.get_computed_blocks = get_computed_blocks
    _run_until(engine, g, found, steps=300)
    assert swapped, "no request was resumed with a prefix-cache hit"
    rid, _, wrong = swapped[0]
    assert found
    f = found[0]
    assert (f.request_id, f.block) == (rid, wrong) and f.position < engine.cfg.block_size
    assert "resumed after preemption" in f.explanation and "wrong blocks" in f.explanation
    assert f.cause is Cause.RESUMED_WRONG_BLOCKS


def test_guard_checks_version_and_arguments(tmp_model, monkeypatch):
    import vllm

    engine = ve.Engine(ve.Config(seed=44, requests=0), tmp_model)
    with pytest.raises(kvv.GuardError, match="on_violation"):
        kvv.guard(engine.scheduler, on_violation="shout")
    with pytest.raises(kvv.GuardError, match="needs a vLLM v1 Scheduler"):
        kvv.guard(object())
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(kvv.GuardError, match="not supported"):
        kvv.guard(engine.scheduler)


_PLUGIN_RUN = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm_engine as ve
engine = ve.Engine(ve.Config(seed=40, num_blocks=16, requests=14), sys.argv[1])
from kvcanary.integrations.vllm import plugin
assert len(plugin.GUARDS) == 1, "the entry point installed no guard"
s = engine.scheduler
candidates = []
while not candidates:
    engine.step()
    candidates = [(r, b) for r in s.running
                  for b in s.kv_cache_manager.get_blocks(r.request_id).blocks[0][
                      :r.num_computed_tokens // 16] if b.ref_cnt == 1 and not b.is_null]
request, block = candidates[-1]
s.kv_cache_manager.block_pool.free_blocks([block])      # freed while referenced
for _ in range(100):
    try:
        engine.step()
    except (AssertionError, ValueError):
        break
    if plugin.GUARDS[0].findings():
        break
print("FOUND", len(plugin.GUARDS[0].findings()), request.request_id)
"""


def test_plugin_through_its_entry_point(tmp_path, tmp_model):
    from importlib.metadata import entry_points

    if not any(ep.name == "kvcanary" for ep in entry_points(group="vllm.general_plugins")):
        pytest.skip("kvcanary is not installed in this environment (its entry point is "
                    "registered by pip install)")
    dump = tmp_path / "last.npz"
    env = dict(os.environ, KVCANARY_VLLM="1", KVCANARY_VLLM_DUMP=str(dump),
               VLLM_PLUGINS="kvcanary",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                           os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _PLUGIN_RUN, str(tmp_model)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = int(run.stdout.split("FOUND ")[1].split()[0])
    assert found > 0, run.stdout + run.stderr[-3000:]
    log = tmp_path / "engine.log"
    log.write_text(run.stderr)
    assert "kvcanary: guarding vLLM's scheduler" in run.stderr
    assert "kv_canary violation:" in run.stderr and "freed while still referenced" in run.stderr
    explained = subprocess.run([sys.executable, "-m", "kvcanary", "explain", str(log)],
                               capture_output=True, text=True, timeout=120)
    assert explained.returncode == 1, explained.stdout + explained.stderr
    assert dump.exists()
    audited = subprocess.run([sys.executable, "-m", "kvcanary", "audit", str(dump)],
                             capture_output=True, text=True, timeout=120)
    assert audited.returncode in (0, 1), audited.stdout + audited.stderr


def test_plugin_is_inert_without_its_variable(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvcanary.integrations.vllm import plugin

    monkeypatch.delenv("KVCANARY_VLLM", raising=False)
    before = Scheduler.__init__
    plugin.register()
    assert Scheduler.__init__ is before
    monkeypatch.setenv("KVCANARY_VLLM", "1")
    monkeypatch.setenv("KVCANARY_VLLM_ON_VIOLATION", "shout")
    with pytest.raises(kvv.GuardError, match="KVCANARY_VLLM_ON_VIOLATION"):
        plugin.options()


def _schedules(engine, max_steps=400):
    """What the scheduler handed the model runner, step by step, and the steps run."""
    seen = []
    while (engine.pending or engine.scheduler.has_unfinished_requests()) and \
            engine.steps < max_steps:
        out = engine.step()
        seen.append((sorted(out.num_scheduled_tokens.items()),
                     sorted((n.req_id, n.block_ids) for n in out.scheduled_new_reqs),
                     sorted(out.preempted_req_ids or ())))
    return seen


def test_a_bug_in_the_guard_steps_aside_and_the_engine_runs_on(tmp_model, monkeypatch, caplog):
    import logging

    from kvcanary.integrations.vllm import session as session_module

    cfg = ve.Config(seed=45, num_blocks=12, requests=14)
    unguarded = _schedules(ve.Engine(cfg, tmp_model))
    original, calls = session_module.Session.on_schedule, []

    def broken(self, out):
        calls.append(1)
        if len(calls) == 5:
            raise ZeroDivisionError("a bug in the guard")
        return original(self, out)

    monkeypatch.setattr(session_module.Session, "on_schedule", broken)
    engine = ve.Engine(cfg, tmp_model)
    g = kvv.guard(engine.scheduler, on_violation="raise")
    with caplog.at_level(logging.ERROR, logger="kvcanary"), g:
        guarded = _schedules(engine)
    assert guarded == unguarded and not engine.scheduler.has_unfinished_requests()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "steps aside" in errors[0].getMessage()
    assert errors[0].exc_info and errors[0].exc_info[0] is ZeroDivisionError   # the traceback
    assert len(calls) == 5 and g.summary()["steps"] == 4     # it stopped checking
    assert "ZeroDivisionError: a bug in the guard" in g.summary()["stepped_aside"]
    assert isinstance(g.stepped_aside.__cause__, ZeroDivisionError)


def test_the_plugin_leaves_the_engine_unguarded_when_the_guard_cannot_start(
        tmp_model, monkeypatch, caplog):
    import logging

    from kvcanary.integrations.vllm import guarding, plugin

    def broken(*args, **kwargs):
        raise AttributeError("a bug in the guard")

    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "__init__", Scheduler.__init__)   # restored afterwards
    monkeypatch.setattr(guarding, "guard", broken)
    monkeypatch.setattr(plugin, "GUARDS", [])
    monkeypatch.setenv("KVCANARY_VLLM", "1")
    plugin.register()
    with caplog.at_level(logging.ERROR, logger="kvcanary"):
        engine = ve.Engine(ve.Config(seed=46, requests=4), tmp_model)   # the hooked __init__
    assert getattr(Scheduler.__init__, "_kvcanary", False)
    assert plugin.GUARDS == [] and "schedule" not in engine.scheduler.__dict__
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "runs unguarded" in errors[0].getMessage()
    assert errors[0].exc_info[0] is AttributeError
    engine.run()
    assert not engine.scheduler.has_unfinished_requests()


def test_a_real_finding_still_raises_under_on_violation_raise(tmp_model):
    engine = ve.Engine(ve.Config(seed=40, num_blocks=16, requests=14), tmp_model)
    g = kvv.guard(engine.scheduler, on_violation="raise")
    with g:
        while _running(engine)[0] is None:
            engine.step()
        victim, own, pool = _running(engine)
        pool.free_blocks([own[-1]])            # the bug: freed while the request maps it
        with pytest.raises(kvv.GuardError, match="KV-cache violation") as info:
            for _ in range(200):
                engine.step()
    assert info.value.finding is g.findings()[0] and g.stepped_aside is None
    assert g.summary()["stepped_aside"] is None
