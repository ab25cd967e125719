"""Engine integrations: guard a real serving engine with kvcanary in one line.

Each engine has its own sub-module, which alone imports that engine's framework; importing
``kvcanary`` or this package imports neither torch nor any engine.

* :mod:`kvcanary.integrations.transformers` -- Hugging Face transformers' continuous batching
  (``model.generate_batch``), on the CPU or a CUDA device.
* :mod:`kvcanary.integrations.vllm` -- vLLM's scheduler and KV cache manager (scheduler
  mode, any host), and its general plugin for a deployment.

Rows are attributed to requests and merged across steps by the shared core
(:func:`kvcanary.attribute`, :class:`kvcanary.Merger`); what an integration adds to a
finding (the engine's id of the request, the engine's evidence in the explanation) lives in
:mod:`kvcanary.integrations.findings`. ``docs/engines.md`` is the recipe for another engine.
"""
