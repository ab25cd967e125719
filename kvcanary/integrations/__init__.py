"""Engine integrations: guard a real serving engine with kvcanary in one line.

Each engine has its own sub-module, which alone imports that engine's framework; importing
``kvcanary`` or this package imports neither torch nor any engine.

* :mod:`kvcanary.integrations.transformers` -- Hugging Face transformers' continuous batching
  (``model.generate_batch``), on the CPU or a CUDA device.

What every integration shares (findings merged across steps, their explanations) lives in
:mod:`kvcanary.integrations.findings`. ``docs/engines.md`` is the recipe for another engine.
"""
