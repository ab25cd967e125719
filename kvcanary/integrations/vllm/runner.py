"""Model-runner mode: the real ``slot_mapping`` and the real KV bytes of a vLLM model runner.

The scheduler-mode session (:mod:`.session`) rebuilds the step's block tables from the
``SchedulerOutput``; here the step's launch waits until the model runner has run its
forward, so that

* the records are written where the forward wrote the KV: at the ``slot_mapping`` each
  attention layer passes to its backend's ``do_kv_cache_update`` (vLLM's
  ``reshape_and_cache`` step), token by token in the runner's batch order
  (``input_batch.req_ids``), and a slot that differs from the block table's is the guard's
  ``write_index_mismatch``;
* each record fingerprints the slot's real V bytes (real-KV sources: zero-copy views of the
  layers' KV cache tensors, one per layer and KV head), and the verify that follows
  compares what the step's attention read with what was written, so a V byte changed in
  place is found at the request and position that read it.

The KV cache layout is the CPU attention backend's (ISAs ``vec`` and ``vec16``): per layer
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, each (block, head) holding its K
transposed (``head_size`` rows of ``block_size`` values: one token's K is spread over the
whole block, so it is not fingerprinted), then its V token by token. One KV cache group
(full attention) is supported.
"""

from __future__ import annotations

import time

import numpy as np

from ... import MAX_REAL_KV_SOURCES_LIMIT, RealKvHashMode, RealKvSource
from ...format.errors import GuardError
from .session import Session


# The CPU attention backend's ISAs whose block layout is checked here: each (block, KV head)
# holds its K rows transposed (head_size rows of block_size, so one token's K is spread over
# the block) and then its V rows token by token.
TOKEN_MAJOR_V_ISAS = ("vec", "vec16")


def parse_sources(sources, layers: int) -> tuple:
    """Layer indices whose V rows the records fingerprint, from ``"v-all"`` (every layer),
    ``"v0"`` (layer 0), a list of layer indices or ``()``; ``layers``: how many attention
    layers the cache group has."""
    if isinstance(sources, str):
        if sources == "v-all":
            return tuple(range(layers))
        if sources == "v0":
            return (0,)
        raise GuardError(f"sources must be 'v-all', 'v0' or a list of layer indices, "
                         f"got {sources!r}")
    out = []
    for index, item in enumerate(sources or ()):
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < layers:
            raise GuardError(f"sources[{index}] = {item!r}: a layer index in [0, {layers})")
        out.append(int(item))
    return tuple(out)


def kv_sources(layers: list, wanted: tuple) -> list:
    """``[(name, RealKvSource)]`` over the V rows of the wanted attention layers, one per KV
    head: name ``v1h0`` is layer 1's V of KV head 0. K is not fingerprinted: the CPU
    backend stores a block's K transposed, so a slot's K bytes are not one run of bytes."""
    out = []
    for layer in wanted:
        kv, isa = layers[layer].kv_cache, getattr(layers[layer], "isa", None)
        if isa not in TOKEN_MAJOR_V_ISAS:
            raise GuardError(f"layer {layer} runs the CPU attention ISA {isa!r}; the model-"
                             "runner mode knows the KV block layout of "
                             f"{', '.join(TOKEN_MAJOR_V_ISAS)} only (use sources=())")
        if kv.dim() != 4 or kv.shape[3] % 2 or not kv.is_contiguous():
            raise GuardError(f"layer {layer}'s KV cache has shape {tuple(kv.shape)}; the model-"
                             "runner mode reads the CPU attention backend's contiguous "
                             "[num_blocks, num_kv_heads, block_size, 2 * head_size]")
        blocks, heads, block_size, twice = (int(d) for d in kv.shape)
        token_bytes = (twice // 2) * kv.element_size()
        if token_bytes % 16:
            raise GuardError(f"one token's V row of layer {layer} is {token_bytes} bytes; "
                             "real-KV sources need a multiple of 16 (use sources=())")
        halves = kv.view(blocks, heads, 2, block_size * (twice // 2))
        for head in range(heads):
            rows = halves[:, head, 1]      # a view: (blocks, the block's V rows)
            out.append((f"v{layer}h{head}", RealKvSource(
                rows, page_size=block_size, num_bytes_per_token=token_bytes,
                read_bytes=token_bytes)))
    if len(out) > MAX_REAL_KV_SOURCES_LIMIT:
        raise GuardError(f"{len(out)} real-KV sources (one per layer and KV head) exceed "
                         f"{MAX_REAL_KV_SOURCES_LIMIT}: name fewer layers in sources")
    return out


class RunnerSession(Session):
    """The scheduler-mode session, its launches deferred to the end of the model runner's
    ``execute_model`` and written at the slots the forward wrote."""

    def __init__(self, g, scheduler, runner, sources, hash_mode):
        super().__init__(g, scheduler)
        config = scheduler.kv_cache_config
        if len(config.kv_cache_groups) != 1 or self.groups[0][1] != 0:
            raise GuardError("the model-runner mode guards one full-attention KV cache group; "
                             f"this model has {len(config.kv_cache_groups)} "
                             f"({', '.join(name for _, _, name in self.groups)})")
        self.runner = runner
        self.layer_names = list(config.kv_cache_groups[0].layer_names)
        context = runner.compilation_config.static_forward_context
        missing = [name for name in self.layer_names if name not in context]
        if missing:
            raise GuardError(f"the model runner has no attention layer {missing[0]!r}")
        self.layers = [context[name] for name in self.layer_names]
        wanted = parse_sources(sources, len(self.layers))
        self.real_kv = kv_sources(self.layers, wanted)
        for name, source in self.real_kv:
            if source.num_slots != self.num_slots:
                raise GuardError(f"real-KV source {name} holds {source.num_slots} slots, the "
                                 f"scheduler's pool {self.num_slots}")
        self.source_names = "+".join(name for name, _ in self.real_kv) or "no source"
        self.context = self.new_context([source for _, source in self.real_kv], hash_mode)
        self.pending = {}        # id(SchedulerOutput) -> the step's rows
        self.mapping = None      # the slot_mapping the step's first layer wrote with
        self.saved = []          # (object, attribute, own value or None) to restore

    # -- hooks into the model runner

    def install(self) -> None:
        """Wrap ``execute_model`` and each layer's ``do_kv_cache_update`` (instance
        attributes, removed by :meth:`remove`)."""
        runner = self.runner
        original_execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            g = self.guard
            if g.stepped_aside is not None:
                return original_execute(scheduler_output, *args, **kwargs)
            self.mapping = None
            start = time.perf_counter()
            result = original_execute(scheduler_output, *args, **kwargs)
            engine = time.perf_counter() - start
            if g.stepped_aside is not None:      # it failed during the forward
                return result
            try:
                g.engine_times.append(engine)
                self.after_forward(scheduler_output)
            except Exception as exc:   # a bug in the guard must not stop the engine
                g.step_aside(exc, "after the model runner's execute_model")
                return result
            g.close_step(time.perf_counter() - start - engine)   # a finding may raise here
            return result

        self._wrap(runner, "execute_model", execute_model)
        for layer in self.layers:
            impl = layer.impl
            original_update = impl.do_kv_cache_update

            def do_kv_cache_update(attn_layer, key, value, kv_cache, slot_mapping,
                                   _original=original_update):
                if self.mapping is None and self.guard.stepped_aside is None:
                    try:
                        self.mapping = self.copy_mapping(slot_mapping)
                    except Exception as exc:   # the layer still writes its KV
                        self.guard.step_aside(exc, "at an attention layer's "
                                              "do_kv_cache_update")
                return _original(attn_layer, key, value, kv_cache, slot_mapping)

            self._wrap(impl, "do_kv_cache_update", do_kv_cache_update)

    @staticmethod
    def copy_mapping(slot_mapping) -> np.ndarray:
        """The step's ``slot_mapping`` (a torch tensor) as int64 on the host."""
        return slot_mapping.detach().to("cpu").numpy().astype(np.int64)

    def _wrap(self, obj, name, wrapper) -> None:
        wrapper.__wrapped__ = getattr(obj, name)
        self.saved.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, wrapper)

    def remove(self) -> None:
        for obj, name, own in reversed(self.saved):
            if own is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, own)
        self.saved = []

    # -- one step

    def on_schedule(self, out) -> None:
        rows = self.step_rows(out)
        self.pending = {id(out): (out, rows)}    # the output the runner executes next

    def after_forward(self, out) -> None:
        """The forward wrote the step's KV: write its records where it wrote, then verify."""
        out_rows = self.pending.pop(id(out), None)
        if out_rows is None or not out_rows[1]:
            return
        rows = out_rows[1]
        if self.mapping is None:
            raise GuardError("the forward wrote no KV (no layer's do_kv_cache_update ran), "
                             "so the model-runner mode has no slot_mapping to follow")
        order = [rid for rid in self.runner.input_batch.req_ids if rid in
                 out.num_scheduled_tokens]
        starts = np.cumsum([0] + [out.num_scheduled_tokens[rid] for rid in order])
        start_of = dict(zip(order, starts[:-1].tolist()))
        mapping = self.mapping
        written = []
        for r in rows:
            begin = start_of.get(r.request_id)
            if begin is None:
                raise GuardError(f"request {r.request_id} is scheduled but not in the model "
                                 "runner's batch")
            part = mapping[begin:begin + r.scheduled]
            # a slot_mapping entry outside the pool (vLLM's -1 padding): past the buffer
            written.append(np.where((part < 0) | (part >= self.num_slots), self.num_slots,
                                    part))
        self._launch(rows, written=np.concatenate(written))
        self.last = rows
