"""Forks (``num_return_sequences > 1``) under the transformers guard: clean at 2..8 return
sequences, forking at a block boundary and inside a block, greedy and sampled, with and
without block sharing and under pool pressure; the records a fork copies are what keeps the
children clean, and they are copied where the engine copies its KV."""

from __future__ import annotations

import pytest

import skip_reasons

torch = pytest.importorskip("torch", reason=skip_reasons.transformers_extra("torch"))
transformers = pytest.importorskip(
    "transformers", reason=skip_reasons.transformers_extra("transformers"))

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from kvcanary.integrations import transformers as kvt  # noqa: E402

if not kvt.supported_version(transformers.__version__):
    pytest.skip(f"transformers {transformers.__version__} is outside the supported range "
                f"{kvt.SUPPORTED_RANGE}", allow_module_level=True)

PAGE = 16
PROMPTS = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


@pytest.fixture(autouse=True)
def quiet():
    transformers.utils.logging.set_verbosity_error()
    yield


def fork_prompts(length):
    """Eight prompts sharing all but their last three tokens. The engine prefills all but the
    last token before it forks: a prompt of 43 tokens forks inside block 2 (positions 32..41
    written), one of 33 or 49 at a block boundary."""
    return [list(range(100, 100 + length - 3)) + [200 + i, 300 + i, 400 + i]
            for i in range(PROMPTS)]


def run_forks(model, returns, length=43, greedy=False, share=True, num_blocks=128,
              new_tokens=20):
    guard = kvt.guard(model, sources="k0", hash_mode="all", check_tokens=True,
                      plan_from="read_indices", on_violation=lambda f: None)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=True,
                              num_return_sequences=returns, eos_token_id=-1, pad_token_id=0,
                              **({"top_k": 1} if greedy else {}))
    batching = ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks,
                                        max_batch_tokens=256, max_requests_per_batch=8,
                                        allow_block_sharing=share, seed=1,
                                        use_async_batching=False)
    with guard:
        outputs = model.generate_batch(inputs=fork_prompts(length), generation_config=config,
                                       continuous_batching_config=batching)
    assert len(outputs) == PROMPTS * returns
    assert all(o.error is None for o in outputs.values()), \
        [o.error for o in outputs.values() if o.error][:2]
    assert all(len(o.generated_tokens) == new_tokens for o in outputs.values())
    return guard, outputs


CASES = {   # name: (return sequences, prompt length, greedy, block sharing, pool blocks)
    "issue-config-3-returns": (3, 43, False, True, 128),
    "2-returns": (2, 43, False, True, 128),
    "5-returns-greedy": (5, 43, True, True, 128),
    "8-returns-no-sharing": (8, 43, False, False, 128),
    "4-returns-at-block-boundary": (4, 33, False, True, 128),
    "3-returns-greedy-at-boundary-no-sharing": (3, 49, True, False, 128),
    "8-returns-pool-pressure": (8, 43, False, True, 24),
    "6-returns-greedy-at-boundary-pool-pressure": (6, 33, True, True, 24),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forks_are_clean(model, case):
    returns, length, greedy, share, num_blocks = CASES[case]
    guard, outputs = run_forks(model, returns, length, greedy, share, num_blocks,
                               new_tokens=20 if case.startswith("issue") else 12)
    s = guard.summary()
    assert s["findings"] == 0, [f.describe() for f in guard.findings()[:3]]
    assert s["ring_rows"] == 0 and s["steps"] > 0
    children = PROMPTS * (returns - 1)
    if length % PAGE != 1 or not share:       # a partly written (or unshared) block: copied
        assert s["blocks_copied"] > 0
    if num_blocks < 64:                        # some children did not fit: prefilled anew
        assert s["blocks_copied"] < children * (length // PAGE + 1)
    if greedy:                                 # forked KV continues exactly like the parent's
        for i in range(PROMPTS):
            parent = outputs[f"req_{i}"].generated_tokens
            assert all(outputs[f"req_{i}__child#{k}"].generated_tokens == parent
                       for k in range(returns - 1))


def test_children_need_the_records_a_fork_copies(model, monkeypatch):
    """Without the records the fork copies, each child's copied block does not verify: the
    clean runs above are clean because the copy is right, not because nothing is checked."""
    monkeypatch.setattr(kvt.Session, "copy_records", lambda self, src, dst: None)
    guard, _ = run_forks(model, 3, new_tokens=4)
    found = guard.findings()
    assert found and all("__child#" in f.request_id for f in found)
    assert min(f.position for f in found) == 2 * PAGE     # the block written when it forked


def test_fork_record_copy_queues_on_the_engine_stream(model, monkeypatch):
    """On CUDA the engine copies forked blocks on its compute stream; the records must be
    copied on that stream too, after the step's write launch, not on another stream that may
    run before it. Here (CPU) the stream context is recorded around each record copy."""
    inside, calls = [], []
    original_copy, original_stream = kvt.Session.copy_records, kvt.Session.on_engine_stream

    class Recording:
        def __init__(self, session, processor):
            self.context = original_stream(session, processor)

        def __enter__(self):
            inside.append(True)
            return self.context.__enter__()

        def __exit__(self, *exc):
            inside.pop()
            return self.context.__exit__(*exc)

    def copy_records(self, src, dst):
        calls.append(bool(inside))
        return original_copy(self, src, dst)

    monkeypatch.setattr(kvt.Session, "on_engine_stream",
                        lambda self, processor=None: Recording(self, processor))
    monkeypatch.setattr(kvt.Session, "copy_records", copy_records)
    guard, _ = run_forks(model, 3, new_tokens=2)
    assert calls and all(calls)
    assert guard.summary()["findings"] == 0


def test_a_fork_that_copies_another_requests_block_is_found_at_the_child(model, monkeypatch):
    """The engine's fork copies one parent's partly written block into another parent's
    child (the copy lists rotated): the child reads foreign tokens from position 40 on, and
    the finding names the fork."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    original = PagedAttentionCache.perform_cache_copy
    rotated = []

    def perform_cache_copy(self, copy_src_and_dst):
        for name, (src, dst) in copy_src_and_dst.items():
            if not rotated and len(set(src)) > 1:
                src[:] = src[1:] + src[:1]
                rotated.append(list(zip(src, dst)))
        return original(self, copy_src_and_dst)

    monkeypatch.setattr(PagedAttentionCache, "perform_cache_copy", perform_cache_copy)
    guard, _ = run_forks(model, 2, new_tokens=4)
    assert rotated
    found = guard.findings()
    assert found and all("__child#" in f.request_id for f in found)
    assert min(f.position for f in found) == 40          # the prompts differ from there on
    assert all("the fork copied another request's block" in f.explanation for f in found), \
        [f.describe() for f in found[:2]]



def test_a_fault_in_a_block_a_child_shares_with_its_parent_names_the_fork(model, monkeypatch):
    """A child's first block, shared with its parent by the fork, is freed while both hold it
    and reused (a small pool): the child is told the block it shares with its parent was
    freed, and no child whose block the fork shared is told of a prefix-cache entry."""
    from test_integration_transformers import Fault, allocator

    def pick(io, requests):
        a = allocator(io)
        for rid, blocks in a.block_table.items():
            parent = rid.rsplit("__child#", 1)[0]
            if parent != rid and a.block_table.get(parent, [None])[0] == blocks[0]:
                a.pool.free_blocks(a.index, [blocks[0]])
                return blocks[0], parent
        return None

    fault = Fault("before", pick, min_step=1)
    fault.install(monkeypatch)
    guard, _ = run_forks(model, 3, new_tokens=12, num_blocks=24)
    assert fault.target is not None
    block, parent = fault.target
    children = [f for f in guard.findings() if f.request_id.startswith(parent + "__child#")]
    on_block = [f for f in children if f.block == block]
    assert on_block, [f.describe() for f in guard.findings()[:3]]
    for f in on_block:
        assert (f"block {block}, which {f.request_id} shares with its parent {parent} since "
                "the fork at step") in f.explanation, f.describe()
        assert "was freed at step" in f.explanation, f.describe()
    for f in children:
        assert "prefix" not in f.explanation, f.describe()


def test_a_write_after_the_fork_into_a_shared_block_names_the_fork(model, monkeypatch):
    """Another request's block-table entry is pointed at a block a child shares with its
    parent; its writes overwrite the child's records there: the child is told the block it
    shares with its parent was overwritten after the fork, not of a prefix-cache entry."""
    from test_integration_transformers import Fault, allocator, decoding

    def pick(io, requests):
        a = allocator(io)
        children = [r for r in a.block_table if "__child#" in r and len(a.block_table[r]) > 2]
        for _, f, _ in decoding(requests, io, 2 * PAGE, "before"):
            writer = f.state.request_id
            for child in children:
                parent = child.rsplit("__child#", 1)[0]
                shared = a.block_table[child][1]
                if writer.split("__child#")[0] != parent and \
                        a.block_table[parent][1] == shared:
                    a.block_table[writer][2] = shared
                    return child, parent, shared, writer
        return None

    fault = Fault("before", pick, min_step=4)
    fault.install(monkeypatch)
    guard, _ = run_forks(model, 3, new_tokens=8)
    assert fault.target is not None
    child, parent, block, writer = fault.target
    hits = [f for f in guard.findings() if f.request_id == child and f.block == block]
    assert hits, [f.describe() for f in guard.findings()[:3]]
    text = (f"{child} shares block {block} with its parent {parent} since the fork at step")
    assert any(text in f.explanation and f"then {writer} wrote" in f.explanation
               and "overwritten" in f.explanation for f in hits), [f.describe() for f in hits]
    assert all("prefix" not in f.explanation for f in hits), [f.describe() for f in hits]
