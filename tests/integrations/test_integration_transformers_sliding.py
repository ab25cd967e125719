"""kvcanary guarding sliding-window and hybrid models in transformers' continuous batching:
tiny random Mistral (every layer sliding, window 16, and Mistral's default 4096) and Qwen2
(layer 0 full attention, layer 1 sliding). Clean runs give no finding and the same tokens
as without the guard; faults inside a window are found at their request and position; what
happens to a slot after its position slid out of the window is no finding; what kvcanary
cannot guard is refused at guard()."""

from __future__ import annotations

import random

import pytest

import skip_reasons

torch = pytest.importorskip("torch", reason=skip_reasons.transformers_extra("torch"))
transformers = pytest.importorskip(
    "transformers", reason=skip_reasons.transformers_extra("transformers"))

from click.testing import CliRunner  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.input_outputs import (  # noqa: E402
    ContinuousBatchingIOs,
)

from kvcanary.cli import main  # noqa: E402
from kvcanary.integrations import transformers as kvt  # noqa: E402

if not kvt.supported_version(transformers.__version__):
    pytest.skip(f"transformers {transformers.__version__} is outside the supported range "
                f"{kvt.SUPPORTED_RANGE}", allow_module_level=True)

PAGE = 8
WINDOW = 16           # two blocks of ring per request
VOCAB = 128
SLIDING = "sliding_attention"
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def mistral(window=WINDOW, default=False):
    """Mistral with ``sliding_window=window`` (None: full attention), or its default."""
    torch.manual_seed(0)
    config = MistralConfig(**SIZES, **({} if default else {"sliding_window": window}))
    config._attn_implementation = "sdpa"
    return MistralForCausalLM(config).eval()


def qwen2_hybrid(layer_types=("full_attention", SLIDING)):
    torch.manual_seed(0)
    config = Qwen2Config(**SIZES, sliding_window=WINDOW, use_sliding_window=True,
                         layer_types=list(layer_types))
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def sliding_model():
    return mistral()


@pytest.fixture(scope="module")
def hybrid_model():
    return qwen2_hybrid()


@pytest.fixture(autouse=True)
def quiet():
    transformers.utils.logging.set_verbosity_error()
    yield


def prompts(count=16, seed=0, longest=50):
    """Prompts of 5 to ``longest`` tokens: most are longer than the window."""
    r = random.Random(seed)
    return [[r.randrange(1, VOCAB) for _ in range(r.randrange(5, longest))]
            for _ in range(count)]


def generation(forks=1, new_tokens=24):
    sample = forks > 1
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=sample, eos_token_id=None,
                            pad_token_id=0, num_return_sequences=forks,
                            **({"top_k": 0} if sample else {}))


def batching(num_blocks=64, max_batch_tokens=64):
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks,
                                    max_batch_tokens=max_batch_tokens, max_requests_per_batch=8,
                                    use_async_batching=False)


def generate(model, guard=None, *, forks=1, cb=None, inputs=None):
    torch.manual_seed(1)         # the same samples with and without the guard
    kwargs = dict(inputs=inputs or prompts(), generation_config=generation(forks),
                  continuous_batching_config=cb or batching())
    if guard is None:
        outputs = model.generate_batch(**kwargs)
    else:
        with guard:
            outputs = model.generate_batch(**kwargs)
    assert all(o.error is None for o in outputs.values()), [o.error for o in outputs.values()]
    return {rid: o.generated_tokens for rid, o in outputs.items()}


# ------------------------------------------------------------------ clean runs

CLEAN = {   # model, return sequences, batching, guard arguments
    # a chunk longer than the window (64 tokens a batch), decoding far past it
    "mistral-window-16": (lambda: mistral(), 1, batching(), {}),
    # a window that is no whole number of blocks (the ring's second block half used)
    "mistral-window-12": (lambda: mistral(12), 1, batching(),
                          dict(plan_from="block_table", hash_mode="partial")),
    # prompts prefilled in chunks of 16 under a small pool
    "mistral-window-16-chunked": (lambda: mistral(), 1, batching(24, 16),
                                  dict(check_tokens=False)),
    # forks copy every ring block (a sliding group shares none)
    "qwen2-hybrid-forks": (qwen2_hybrid, 2, batching(40, 32), {}),
    # the sliding group first: its row 0 of the engine's read and write indices
    "qwen2-hybrid-sliding-first": (lambda: qwen2_hybrid((SLIDING, "full_attention")), 1,
                                   batching(), {}),
    "mistral-default-window": (lambda: mistral(default=True), 1, batching(), {}),
}


@pytest.mark.parametrize("name", list(CLEAN))
def test_clean_run_no_finding_and_the_same_tokens(name):
    make, forks, cb, guard_kw = CLEAN[name]
    model = make()
    assert model.config.sliding_window is not None
    unguarded = generate(model, forks=forks, cb=cb)
    guard = kvt.guard(model, **{"sources": "kv-all", "on_violation": "raise", **guard_kw})
    assert generate(model, guard, forks=forks, cb=cb) == unguarded
    s = guard.summary()
    assert s["findings"] == 0 and s["ring_rows"] == 0, [f.describe() for f in guard.findings()]
    # kvcanary's window is exactly the slots attention gathered, every step
    assert s["read_index_mismatches"] == 0 and s["write_index_mismatches"] == 0
    assert s["steps"] > 20 and s["entries_verified"] > 0
    groups = s["cache_groups"]
    assert {g["name"]: g["layers"] for g in groups} == _group_names(model)
    assert sum(g["entries_verified"] for g in groups) == s["entries_verified"]
    for g in groups:
        assert g["sources"] == [f"{kind}{layer}" for layer in g["layers"] for kind in "kv"]
        assert g["window"] == (None if g["name"] == "full_attention" else
                               model.config.sliding_window)
    if forks > 1:
        assert s["blocks_copied"] > 0


def _group_names(model):
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    return group_layers_by_attn_type(model.config)


def test_a_window_verifies_at_most_its_cached_positions(hybrid_model):
    # every request reads at most WINDOW - 1 cached positions of the sliding group per step
    guard = kvt.guard(hybrid_model, sources=(), hash_mode="none")
    generate(hybrid_model, guard)
    s = guard.summary()
    full, window = s["cache_groups"]
    assert window["sources"] == [] and window["window"] == WINDOW
    assert 0 < window["entries_verified"] <= s["steps"] * 8 * (WINDOW - 1)
    assert full["entries_verified"] > 2 * window["entries_verified"]


@pytest.mark.parametrize("group", [None, SLIDING])
def test_clean_dump_of_each_group_audits_clean(hybrid_model, tmp_path, group):
    guard = kvt.guard(hybrid_model, sources="kv-all")
    generate(hybrid_model, guard)
    path = guard.dump(tmp_path / "clean.npz", group=group)
    result = CliRunner().invoke(main, ["audit", str(path), "--backend", "numpy"])
    assert result.exit_code == 0, result.output
    assert "CLEAN" in result.output


# ------------------------------------------------------------------ fault injection


class Fault:
    """Injects one fault into the engine's state at the first step (from ``min_step``) where
    ``pick`` finds a target, before or after the step's batch tensors are prepared."""

    def __init__(self, phase, pick, min_step=4):
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


def sliding(io):
    return io.cache.cache_allocators[SLIDING]


def decoding(requests, phase, min_past=WINDOW + 2):
    """(batch index, request id, past length) of decoding requests whose window is full."""
    out = []
    for i, f in enumerate(requests):
        past = f.state.position_offset - (f.query_length if phase == "after" else 0)
        if f.query_length == 1 and past >= min_past and f.state.generated_tokens:
            out.append((i, f.state.request_id, past))
    return out


def ring(io, request_id, position):
    """(block, offset) of a position in the request's ring of sliding blocks."""
    a = sliding(io)
    index = position % a.sliding_window
    return a.block_table[request_id][index // PAGE], index % PAGE


def flip_k(io, block, offset):
    """Flip one byte of the first sliding layer's K row at (block, offset)."""
    a = sliding(io)
    token_bytes = a.num_key_value_heads * a.head_dim * a.cache_dtype.itemsize
    a._copy_view[block, offset * token_bytes + 3] ^= 0x10


def found(guard, request_id, position=None, reason=None):
    return [f for f in guard.findings()
            if f.request_id == request_id and (position is None or f.position == position)
            and (reason is None or any(reason in r for r in f.reasons))]


def run_fault(model, monkeypatch, fault, cb=None, **guard_kw):
    fault.install(monkeypatch)
    guard = kvt.guard(model, **{"on_violation": lambda f: None, **guard_kw})
    tokens = generate(model, guard, cb=cb)
    assert fault.target is not None, "the fault found no target"
    return guard, fault.target, tokens


@pytest.mark.parametrize("which", ["sliding", "hybrid"])
def test_k_byte_flip_inside_the_window_is_found_once(which, sliding_model, hybrid_model,
                                                     monkeypatch):
    model = sliding_model if which == "sliding" else hybrid_model
    sources = "k0" if which == "sliding" else [("k", 1)]     # the sliding layer's K

    def pick(io, requests):     # the window head: read this step, slid out the next
        for _, rid, past in decoding(requests, "before"):
            head = past - (WINDOW - 1)
            flip_k(io, *ring(io, rid, head))
            return rid, head

    guard, (rid, head), _ = run_fault(model, monkeypatch, Fault("before", pick),
                                      sources=sources)
    hits = found(guard, rid, head)
    assert [f.reasons for f in hits] == [("verify_real_kv_hash",)], guard.findings()
    assert hits[0].count == 1               # the next step's window no longer reads it
    assert "launch_tag=TAIL_K_SWA" in hits[0].log_line
    assert "changed after they were written" in hits[0].explanation
    if which == "hybrid":
        assert hits[0].explanation.startswith("sliding_attention group: ")
    assert all(f.request_id == rid for f in guard.findings())


def test_k_byte_flip_of_a_slid_out_position_is_no_finding(sliding_model, monkeypatch):
    clean = generate(sliding_model)

    def pick(io, requests):     # the position before the window: this step overwrites it
        for _, rid, past in decoding(requests, "before"):
            flip_k(io, *ring(io, rid, past - WINDOW))
            return rid, past - WINDOW

    guard, _, tokens = run_fault(sliding_model, monkeypatch, Fault("before", pick))
    assert guard.findings() == [] and guard.summary()["ring_rows"] == 0
    assert tokens == clean                  # attention never read the flipped byte


@pytest.mark.parametrize("ahead, owner_finds", [(1, False), (2, True)])
def test_another_requests_write_into_a_ring_slot(sliding_model, monkeypatch, ahead,
                                                 owner_finds):
    """Another request's write lands in the slot of the owner's window head (``ahead=1``),
    which slides out before the owner reads again: a finding for the writer only. One
    position later (``ahead=2``) the slot is still inside the owner's next window."""

    def pick(io, requests):
        cands = decoding(requests, "after")
        if len(cands) < 2:
            return None
        (i, writer, writer_past), (_, owner, owner_past) = cands[:2]
        target = owner_past - (WINDOW - 1) + ahead - 1
        block, offset = ring(io, owner, target)
        index = sum(f.query_length for f in requests[:i])
        group = sliding(io).index
        io.write_index_storage[group, index] = block * sliding(io).block_physical_stride + offset
        return writer, writer_past, owner, target

    guard, (writer, writer_past, owner, target), _ = run_fault(
        sliding_model, monkeypatch, Fault("after", pick))
    at_writer = found(guard, writer, writer_past, "write_index_mismatch")
    assert at_writer and "misdirected write" in at_writer[0].explanation, guard.findings()
    at_owner = found(guard, owner)
    if owner_finds:     # the overwritten position, and its chain successor's link
        assert {f.position for f in at_owner} <= {target, target + 1}, guard.findings()
        hit = found(guard, owner, target)
        assert hit and writer in hit[0].explanation, [f.describe() for f in at_owner]
    else:
        assert at_owner == [], [f.describe() for f in at_owner]


def test_ring_block_freed_while_in_the_window_then_reused(sliding_model, monkeypatch):
    def pick(io, requests):
        for _, rid, past in decoding(requests, "before"):
            a = sliding(io)
            block = a.block_table[rid][0]
            a.pool.free_blocks(a.index, [block])       # the request still holds it
            return rid, block

    guard, (rid, block), _ = run_fault(sliding_model, monkeypatch,
                                       Fault("before", pick, min_step=3), cb=batching(24))
    hits = [f for f in found(guard, rid) if f.block == block]
    assert hits, [f.describe() for f in guard.findings()]
    assert any("freed" in f.explanation and "reused" in f.explanation for f in hits)


def test_ring_block_remapped_onto_another_requests_block(hybrid_model, monkeypatch):
    def pick(io, requests):
        cands = decoding(requests, "before")
        if len(cands) < 2:
            return None
        (_, victim, past), (_, other, _) = cands[:2]
        a = sliding(io)
        a.block_table[victim][1] = a.block_table[other][1]
        # the first position of the window that ring block 1 holds
        first = next(p for p in range(past - (WINDOW - 1), past) if p % WINDOW >= PAGE)
        return victim, first

    guard, (victim, first), _ = run_fault(hybrid_model, monkeypatch, Fault("before", pick),
                                          sources="kv-all")
    hits = found(guard, victim, first, "verify")
    assert hits, [f.describe() for f in guard.findings()]
    assert "remapped" in hits[0].explanation
    assert hits[0].explanation.startswith("sliding_attention group: ")
    # the full-attention group of the same request saw nothing
    assert not [f for f in found(guard, victim) if f.explanation.startswith("full_attention")]


# ------------------------------------------------------------------ refused at guard()


def test_unsupported_layer_type_is_refused_at_guard():
    model = qwen2_hybrid()
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(kvt.GuardError, match=r"'chunked_attention' \(layers 1\)"):
        kvt.guard(model)


def test_window_of_one_token_is_refused_at_guard():
    with pytest.raises(kvt.GuardError, match=r"sliding_window=1 .*at least 2 tokens"):
        kvt.guard(mistral(window=1))


def test_no_sliding_window_is_one_full_attention_group():
    model = mistral(window=None)
    guard = kvt.guard(model)
    generate(model, guard, inputs=prompts(4))
    assert [g.group_name for g in guard.session.groups] == ["full_attention"]
    assert guard.summary()["findings"] == 0


# ------------------------------------------------------------------ offloading


class _TorchWithoutPinnedMemory:
    """torch as the offloading manager sees it: a CPU-only build has no pinned memory, so the
    CPU swap pool is allocated as plain memory (the copies are the same)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory=False, **kwargs):
        return torch.empty(*args, **kwargs)


def test_offloaded_kv_of_both_groups_comes_back_with_its_records(hybrid_model, monkeypatch):
    from transformers.generation.continuous_batching import offloading_manager

    from kvcanary.integrations.transformers import groups

    monkeypatch.setattr(offloading_manager, "torch", _TorchWithoutPinnedMemory())
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=16, max_batch_tokens=64,
                                  max_requests_per_batch=8, use_async_batching=False,
                                  cpu_offload_space=0.001)    # too small for 16 requests
    clean = generate(hybrid_model, cb=cb)
    guard = kvt.guard(hybrid_model, sources="kv-all")
    assert generate(hybrid_model, guard, cb=cb) == clean
    s = guard.summary()
    assert s["blocks_restored"] > 0 and s["findings"] == 0, guard.findings()[:2]
    # Without the sliding group's records coming back, its restored ring would not verify.
    monkeypatch.setattr(groups._SlidingSession, "restore_records", lambda self, state: None)
    guard = kvt.guard(hybrid_model, sources="kv-all", on_violation=lambda f: None)
    generate(hybrid_model, guard, cb=cb)
    assert guard.findings()
    assert all(f.explanation.startswith("sliding_attention group: ") for f in guard.findings())
