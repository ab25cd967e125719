"""kvcanary guarding transformers' continuous batching on a tiny randomly initialised Llama:
clean runs give no finding, faults injected into the engine's own state are found and
attributed to the right request and position, and transformers is left as it was."""

from __future__ import annotations

import contextlib
import logging
import random
import sys

import numpy as np
import pytest

import skip_reasons

torch = pytest.importorskip("torch", reason=skip_reasons.transformers_extra("torch"))
transformers = pytest.importorskip(
    "transformers", reason=skip_reasons.transformers_extra("transformers"))

from click.testing import CliRunner  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching import continuous_api  # noqa: E402
from transformers.generation.continuous_batching.input_outputs import (  # noqa: E402
    ContinuousBatchingIOs,
)

from kvcanary.cli import main  # noqa: E402
from kvcanary.findings.causes import Cause  # noqa: E402
from kvcanary.integrations import transformers as kvt  # noqa: E402

if not kvt.supported_version(transformers.__version__):
    pytest.skip(f"transformers {transformers.__version__} is outside the supported range "
                f"{kvt.SUPPORTED_RANGE}", allow_module_level=True)

PAGE = 8
PREFIX = 24          # three shared blocks
VOCAB = 128


def make_model(attn="sdpa", layers=2):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    config._attn_implementation = attn
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return make_model()


def prompts(count=40, seed=0):
    r = random.Random(seed)
    prefix = [r.randrange(1, VOCAB) for _ in range(PREFIX)]
    return [prefix + [r.randrange(1, VOCAB) for _ in range(r.randrange(10, 20))]
            for _ in range(count)]


def generation(forks=1, new_tokens=8):
    sample = forks > 1
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=sample, eos_token_id=None,
                            pad_token_id=0, num_return_sequences=forks,
                            **({"top_k": 0} if sample else {}))


def batching(num_blocks=64, max_batch_tokens=64, **kw):
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks,
                                    max_batch_tokens=max_batch_tokens, max_requests_per_batch=8,
                                    use_async_batching=False, **kw)


def run(model, *, inputs=None, forks=1, new_tokens=8, cb=None, **guard_kw):
    guard = kvt.guard(model, **{"on_violation": lambda f: None, **guard_kw})
    with guard:
        outputs = model.generate_batch(inputs=inputs or prompts(),
                                       generation_config=generation(forks, new_tokens),
                                       continuous_batching_config=cb or batching())
    assert_causes_are_the_vocabulary(guard.findings())
    return guard, outputs


def assert_causes_are_the_vocabulary(findings):
    """Every cause a guard's finding carries is a member of the one Cause enum, stated in
    its words (the cache group's name before it where a model has several)."""
    for f in findings:
        assert f.cause in Cause and f.explanation.endswith(f.diagnosis.text), f.describe()
        assert f.to_dict()["diagnosis"]["cause"] == f.cause.value


@pytest.fixture(autouse=True)
def quiet():
    transformers.utils.logging.set_verbosity_error()
    yield


# ------------------------------------------------------------------ clean runs


@pytest.mark.parametrize("attn", ["sdpa", "paged|eager"])
def test_clean_run_with_prefix_hits_forks_evictions_and_chunked_prefill(attn):
    model = make_model(attn)
    # 40 prompts sharing a 24-token prefix, 2 samples each (forks), a pool of 40 blocks for
    # 80 sequences (evictions) and 32 tokens per batch (prompts prefilled in chunks).
    guard, outputs = run(model, forks=2, cb=batching(num_blocks=40, max_batch_tokens=32),
                         sources="kv-all")
    assert len(outputs) == 80 and all(o.error is None for o in outputs.values())
    s = guard.summary()
    assert s["findings"] == 0, [f.describe() for f in guard.findings()[:3]]
    assert s["blocks_copied"] > 0                 # forks happened
    assert s["entries_verified"] > 10 * s["tokens_written"]
    assert s["steps"] > 40 and s["ring_rows"] == 0


def test_clean_run_block_table_plan_and_token_check_off(model):
    guard, outputs = run(model, plan_from="block_table", check_tokens=False, hash_mode="partial")
    assert guard.summary()["findings"] == 0 and len(outputs) == 40


def test_clean_dump_audits_clean(model, tmp_path):
    guard, _ = run(model)
    path = guard.dump(tmp_path / "clean.npz")
    result = CliRunner().invoke(main, ["audit", str(path), "--backend", "numpy"])
    assert result.exit_code == 0, result.output
    assert "CLEAN" in result.output


# ------------------------------------------------------------------ fault injection


class Fault:
    """Injects one fault into the engine's state at the first step where ``pick`` finds a
    target; ``phase`` says whether before the batch is prepared or after."""

    def __init__(self, phase, pick, min_step=6):
        self.phase, self.pick, self.min_step = phase, pick, min_step
        self.step, self.target = 0, None

    def install(self, monkeypatch):
        original = ContinuousBatchingIOs.prepare_batch_tensors
        fault = self

        def prepare(io, requests_in_batch, *args, **kwargs):
            fault.step += 1
            if fault.phase == "before":
                fault.maybe_fire(io, requests_in_batch)
            original(io, requests_in_batch, *args, **kwargs)
            if fault.phase == "after":
                fault.maybe_fire(io, requests_in_batch)

        monkeypatch.setattr(ContinuousBatchingIOs, "prepare_batch_tensors", prepare)

    def maybe_fire(self, io, requests):
        if self.target is None and self.step >= self.min_step:
            self.target = self.pick(io, requests)


def allocator(io):
    return next(iter(io.cache.cache_allocators.values()))


def decoding(requests, io, min_len, phase="after"):
    """(batch index, future, past length) of decoding requests of at least ``min_len``."""
    out = []
    for i, f in enumerate(requests):
        past = f.state.position_offset - (f.query_length if phase == "after" else 0)
        if f.query_length == 1 and f.has_new_token and past >= min_len and \
                f.state.generated_tokens:
            out.append((i, f, past))
    return out


def token_index(requests, i):
    return sum(f.query_length for f in requests[:i])


def physical(io, block, offset):
    return block * allocator(io).block_physical_stride + offset


def flip_byte(io, block, offset, row):
    """Flip one byte of the KV row ``row`` (0: layer 0 K, 1: layer 0 V, 2: layer 1 K, ...)."""
    a = allocator(io)
    token_bytes = a.num_key_value_heads * a.head_dim * a.cache_dtype.itemsize
    a._copy_view[block, (row * a.tokens_per_page + offset) * token_bytes + 3] ^= 0x10


def found(guard, request_id, position=None, reason=None):
    return [f for f in guard.findings()
            if f.request_id == request_id and (position is None or f.position == position)
            and (reason is None or any(reason in r for r in f.reasons))]


def run_fault(model, monkeypatch, fault, **kw):
    fault.install(monkeypatch)
    guard, outputs = run(model, **kw)
    assert fault.target is not None, "the fault found no target"
    assert len(outputs) == 40 and all(o.error is None for o in outputs.values())
    return guard, fault.target


def kv_flip(row):
    def pick(io, requests):
        for _, f, past in decoding(requests, io, PREFIX + PAGE, "before"):
            block = allocator(io).block_table[f.state.request_id][PREFIX // PAGE]
            flip_byte(io, block, 5, row)
            return f.state.request_id, PREFIX + 5
    return pick


def test_kv_byte_flip_in_layer0_k(model, monkeypatch):
    guard, (rid, pos) = run_fault(model, monkeypatch, Fault("before", kv_flip(0)))
    hits = found(guard, rid, pos)
    assert hits and hits[0].reasons == ("verify_real_kv_hash",), guard.findings()
    assert "changed after they were written" in hits[0].explanation
    assert hits[0].count >= 1 and hits[0].last_step >= hits[0].first_step
    assert all(f.request_id == rid for f in guard.findings())


def test_kv_byte_flip_in_layer1_v_needs_kv_all(model, monkeypatch):
    guard, (rid, pos) = run_fault(model, monkeypatch, Fault("before", kv_flip(3)),
                                  sources="kv-all")
    hits = found(guard, rid, pos, "verify_real_kv_hash")
    assert hits and "v1" in hits[0].explanation
    monkeypatch.undo()
    guard, (rid, pos) = run_fault(model, monkeypatch, Fault("before", kv_flip(3)), sources="k0")
    assert guard.findings() == []          # layer 1's V is not fingerprinted with k0


def test_block_table_entry_remapped_onto_another_requests_block(model, monkeypatch):
    def pick(io, requests):
        cands = decoding(requests, io, PREFIX + PAGE, "before")
        if len(cands) < 2:
            return None
        (_, victim, _), (_, other, _) = cands[:2]
        a, k = allocator(io), PREFIX // PAGE
        a.block_table[victim.state.request_id][k] = a.block_table[other.state.request_id][k]
        return victim.state.request_id, PREFIX

    guard, (rid, pos) = run_fault(model, monkeypatch, Fault("before", pick))
    hits = found(guard, rid, pos, "verify")
    assert hits, [f.describe() for f in guard.findings()]
    assert "remapped" in hits[0].explanation
    assert hits[0].count > 1                    # seen again every later step, merged


def test_block_freed_while_held_then_reused(model, monkeypatch):
    def pick(io, requests):
        for _, f, past in decoding(requests, io, PREFIX + PAGE, "before"):
            a = allocator(io)
            block = a.block_table[f.state.request_id][PREFIX // PAGE]
            a.pool.free_blocks(a.index, [block])       # the request still holds it
            return f.state.request_id, block

    fault = Fault("before", pick, min_step=3)
    guard, (rid, block) = run_fault(model, monkeypatch, fault, cb=batching(num_blocks=40))
    hits = [f for f in found(guard, rid) if f.block == block]
    assert hits, [f.describe() for f in guard.findings()]
    assert any("freed" in f.explanation and "reused" in f.explanation for f in hits)


def test_position_offset_shifted_by_one(model, monkeypatch):
    def pick(io, requests):
        for _, f, past in decoding(requests, io, PREFIX, "before"):
            if (past + 1) % PAGE not in (0, 1):   # stays inside the allocated block
                f.state.position_offset += 1
                return f.state.request_id, past
    guard, (rid, pos) = run_fault(model, monkeypatch, Fault("before", pick))
    hits = found(guard, rid, pos, "write_position")
    assert hits and "shifted by +1" in hits[0].explanation, guard.findings()
    assert found(guard, rid, pos, "verify")      # the skipped slot is read later


def test_position_ids_off_by_one_with_the_right_slot(model, monkeypatch):
    def pick(io, requests):
        for i, f, past in decoding(requests, io, PREFIX):
            io.position_ids[token_index(requests, i)] += 1
            return f.state.request_id, past
    guard, (rid, pos) = run_fault(model, monkeypatch, Fault("after", pick))
    hits = found(guard, rid, pos, "write_position")
    assert hits and "position id" in hits[0].explanation
    assert WRITE_INDEX not in hits[0].reasons
    later = found(guard, rid, pos, "verify_position")
    assert later and "off by +1" in later[0].explanation and later[0].count > 1


WRITE_INDEX = "write_index_mismatch"


def test_lost_write_to_the_trash_block(model, monkeypatch):
    def pick(io, requests):
        for i, f, past in decoding(requests, io, PREFIX):
            io.write_index_storage[0, token_index(requests, i)] = allocator(io).write_trash_index
            return f.state.request_id, past
    guard, (rid, pos) = run_fault(model, monkeypatch, Fault("after", pick))
    hits = found(guard, rid, pos, WRITE_INDEX)
    assert hits and "lost write" in hits[0].explanation, guard.findings()
    later = [f for f in found(guard, rid, pos) if WRITE_INDEX not in f.reasons]
    assert later and "trash" in later[0].explanation


def test_misdirected_write_names_writer_and_victim(model, monkeypatch):
    def pick(io, requests):
        cands = decoding(requests, io, PREFIX + PAGE)
        if len(cands) < 2:
            return None
        (i, writer, past), (_, victim, _) = cands[:2]
        block = allocator(io).block_table[victim.state.request_id][PREFIX // PAGE]
        io.write_index_storage[0, token_index(requests, i)] = physical(io, block, 2)
        return writer.state.request_id, past, victim.state.request_id, PREFIX + 2

    guard, (writer, pos, victim, victim_pos) = run_fault(model, monkeypatch, Fault("after", pick))
    at_writer = found(guard, writer, pos, WRITE_INDEX)
    assert at_writer and "misdirected write" in at_writer[0].explanation
    assert victim in at_writer[0].explanation
    at_victim = found(guard, victim, victim_pos, "verify")
    assert at_victim and writer in at_victim[0].explanation, guard.findings()


def test_misread_read_indices_wrong_write_path_right(model, monkeypatch):
    def pick(io, requests):
        cands = decoding(requests, io, PREFIX + PAGE)
        if len(cands) < 2 or io.true_read_sizes[0] == 0:
            return None
        (i, reader, _), (_, other, _) = cands[:2]
        start = sum(f.state.position_offset for f in requests[:i])   # full-attention reads
        block = allocator(io).block_table[other.state.request_id][PREFIX // PAGE]
        io.read_index_storage[0, start + PREFIX + 1] = physical(io, block, 1)
        return reader.state.request_id, PREFIX + 1

    guard, (rid, pos) = run_fault(model, monkeypatch, Fault("after", pick))
    hits = found(guard, rid, pos, "read_index_mismatch")
    assert hits and "misread" in hits[0].explanation, guard.findings()
    assert hits[0].count == 1                   # only that step read wrongly
    assert "misread" in found(guard, rid, pos + 1)[0].explanation   # its chain successor
    assert not found(guard, rid, reason=WRITE_INDEX)


def test_faulted_dump_audits_with_the_finding(model, monkeypatch, tmp_path):
    def pick(io, requests):            # a shared prefix block: every later request reads it
        block = allocator(io).block_table[requests[0].state.request_id][0]
        flip_byte(io, block, 4, 0)
        return block
    fault = Fault("before", pick, min_step=3)
    fault.install(monkeypatch)
    guard, _ = run(model, cb=batching(num_blocks=200))
    assert guard.findings()
    path = guard.dump(tmp_path / "faulted.npz")
    result = CliRunner().invoke(main, ["audit", str(path), "--backend", "numpy"])
    assert result.exit_code == 1, result.output
    assert "verify_real_kv_hash" in result.output
    assert f"slot_idx={fault.target * PAGE + 4}" in result.output


# ------------------------------------------------------------------ on_violation


def test_on_violation_log_raise_and_callable(model, monkeypatch, caplog):
    fault = Fault("before", kv_flip(0))
    fault.install(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        guard, _ = run(model, on_violation="log")
    records = [r for r in caplog.records if r.name == "kvcanary"]
    assert len(records) == len(guard.findings()) >= 1
    rid, pos = fault.target
    assert "kv_canary violation:" in records[0].getMessage()
    assert f"request={rid} position={pos}" in records[0].getMessage()

    seen = []
    fault.target, fault.step = None, 0
    guard, _ = run(model, on_violation=seen.append)
    assert seen == guard.findings() and seen

    fault.target, fault.step = None, 0
    guard = kvt.guard(model, on_violation="raise")
    with guard, pytest.raises(kvt.GuardError) as err:
        model.generate_batch(inputs=prompts(), generation_config=generation(),
                             continuous_batching_config=batching())
    assert err.value.finding is not None and err.value.finding.request_id == fault.target[0]
    assert "verify_real_kv_hash" in str(err.value)


# ------------------------------------------------------------------ leaving no trace


def _engine_state(model):
    import transformers.generation.continuous_batching as cb
    from transformers.generation.continuous_batching import (
        cache_allocators,
        offloading_manager,
    )

    owners = [continuous_api.ContinuousBatchProcessor, ContinuousBatchingIOs,
              cache_allocators.CacheAllocator, cache_allocators.FullAttentionCacheAllocator,
              offloading_manager.OffloadingManager, type(model)]
    modules = [cb, continuous_api, offloading_manager, cache_allocators]
    return ([dict(vars(o)) for o in owners], [dict(vars(m)) for m in modules],
            dict(vars(model)))


def test_leaves_transformers_as_it_was_also_on_exception():
    # A model no guard has touched yet: one that earlier tests guarded would carry their
    # leftovers into the snapshot and hide them.
    model = make_model()
    inputs = prompts(12)
    before = model.generate_batch(inputs=inputs, generation_config=generation(),
                                  continuous_batching_config=batching())
    state = _engine_state(model)
    with kvt.guard(model):
        assert _engine_state(model) != state     # the hooks are in place inside
    assert _engine_state(model) == state
    with pytest.raises(ZeroDivisionError):
        with kvt.guard(model):
            model.generate_batch(inputs=inputs, generation_config=generation(),
                                 continuous_batching_config=batching())
            1 / 0
    assert _engine_state(model) == state
    after = model.generate_batch(inputs=inputs, generation_config=generation(),
                                 continuous_batching_config=batching())
    assert {k: v.generated_tokens for k, v in after.items()} == \
        {k: v.generated_tokens for k, v in before.items()}


def test_guard_affects_only_its_model(model):
    other = make_model()
    guard = kvt.guard(model)
    with guard:
        other.generate_batch(inputs=prompts(8), generation_config=generation(),
                             continuous_batching_config=batching())
    assert guard.summary()["steps"] == 0


def test_unsupported_version_gets_one_clear_error(model, monkeypatch):
    # the module object transformers registered (it may replace its first one lazily)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.12.0")
    with pytest.raises(kvt.GuardError, match=r"transformers 5\.12\.0 is not supported.*"
                                             r">=5\.20,<5\.25"):
        kvt.guard(model)


@pytest.mark.parametrize("kw, match", [(dict(sources="k9"), "sources"),
                                       (dict(sources=[("q", 0)]), r"sources\[0\]"),
                                       (dict(sources=[("k", 7)]), r"layer in \[0, 2\)"),
                                       (dict(hash_mode="most"), "hash_mode"),
                                       (dict(plan_from="slots"), "plan_from"),
                                       (dict(on_violation="shout"), "on_violation")])
def test_bad_arguments_name_the_argument(model, kw, match):
    with pytest.raises(kvt.GuardError, match=match):
        kvt.guard(model, **kw)


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
def test_guard_runs_the_cuda_kernels_on_engine_tensors():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch sees none)")
    model = make_model().to("cuda")
    guard, outputs = run(model, sources="kv-all")
    assert guard.summary()["findings"] == 0 and len(outputs) == 40
    assert guard.session.xp.__name__ == "cupy"
    assert np.asarray(guard.summary()["entries_verified"]) > 0


# ------------------------------------------------------------------ demo


class EngineLog(logging.Handler):
    """What transformers' loggers write, as their own console handlers would show it."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")

    @contextlib.contextmanager
    def attached(self):
        # continuous batching's own logger (its module moved between versions, its name not)
        loggers = (logging.getLogger("ContinuousBatchingLogger"), logging.getLogger("transformers"))
        for logger in loggers:
            logger.addHandler(self)
        try:
            yield self
        finally:
            for logger in loggers:
                logger.removeHandler(self)


def test_demo_engine_transformers_finds_the_injected_fault(monkeypatch):
    # As where psutil is not installed: transformers then logs ERROR lines about memory
    # breakdowns, which say nothing about the demo and are not shown.
    from transformers.generation.continuous_batching import offloading_manager, utils

    if not hasattr(utils, "is_psutil_available"):
        pytest.skip(f"transformers {transformers.__version__} cannot run on a CPU host without "
                    "psutil, so it logs no advisory about it to drop")
    for module in (utils, offloading_manager):
        monkeypatch.setattr(module, "is_psutil_available", lambda: False)
    with EngineLog().attached() as engine_log:
        result = CliRunner().invoke(main, ["demo", "--engine", "transformers"])
    assert result.exit_code == 0, result.output
    assert "clean run:" in result.output and "0 finding(s)" in result.output
    assert "remapped" in result.output and result.output.rstrip().endswith(
        "the fault was found at its request")
    assert engine_log.lines == []
    assert "psutil" not in result.output and "ERROR" not in result.output


def test_the_demo_drops_only_the_engines_set_up_advisories():
    from kvcanary.tools.engine_logs import without_setup_advisories

    logger = logging.getLogger("ContinuousBatchingLogger")

    with EngineLog().attached() as engine_log:
        with without_setup_advisories():
            logger.error("Cannot get memory breakdown on CPU without psutil: please install "
                         "psutil.")
            logger.error("CUDA out of memory while allocating the cache")
            logging.getLogger("transformers.generation").error("generation failed: bad input")
        logger.error("Cannot get memory breakdown on CPU without psutil: after the demo")
    assert engine_log.lines == [
        "ERROR CUDA out of memory while allocating the cache",
        "ERROR generation failed: bad input",
        "ERROR Cannot get memory breakdown on CPU without psutil: after the demo"]


def test_demo_engine_without_transformers_is_exit_2(monkeypatch):
    import kvcanary.tools.demo as demo

    def missing(*args, **kwargs):
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(demo, "run_engine_demo", missing)
    result = CliRunner().invoke(main, ["demo", "--engine", "transformers"])
    assert result.exit_code == 2 and "kvcanary[transformers]" in result.output
    # The one error style: the prefix every other error has, on one line.
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line.startswith("kvcanary: error: demo --engine transformers needs torch")


# ------------------------------------------------------------------ offloading


class _TorchWithoutPinnedMemory:
    """torch as the offloading manager sees it: a CPU-only build has no pinned memory, so the
    CPU swap pool is allocated as plain memory (the copies are the same)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory=False, **kwargs):
        return torch.empty(*args, **kwargs)


def test_kv_offloaded_to_the_cpu_comes_back_with_its_records(model, monkeypatch):
    from transformers.generation.continuous_batching import offloading_manager

    monkeypatch.setattr(offloading_manager, "torch", _TorchWithoutPinnedMemory())
    cb = batching(num_blocks=24, cpu_offload_space=0.001)     # too small for 40 requests
    guard, outputs = run(model, cb=cb, new_tokens=16)
    assert len(outputs) == 40 and all(o.error is None for o in outputs.values())
    s = guard.summary()
    assert s["blocks_restored"] > 0 and s["findings"] == 0, guard.findings()[:2]
    # Without the records coming back, the restored blocks would not verify.
    monkeypatch.setattr(kvt.Session, "restore_records", lambda self, state: None)
    guard, _ = run(model, cb=cb, new_tokens=16)
    assert guard.summary()["findings"] > 0
