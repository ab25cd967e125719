"""Dump format v1: one canary buffer and the tables needed to verify it.

Three containers hold the same keys (docs/dump-format.md):

* ``.npz``            a numpy zip archive (``numpy.savez``),
* a directory         one ``KEY.npy`` file per key, memory-mapped on load,
* ``.safetensors``    through the ``safetensors`` package's numpy API (optional import);
                      strings live in the file's metadata, KV of dtypes numpy lacks (bf16,
                      fp8) is read as raw bytes.

``save(path, **arrays)`` takes numpy or cupy arrays, anything with ``__dlpack__`` or
``__array__`` (torch tensors work without kvcanary importing torch), Python ints and strings.
``load(path)`` validates every key and returns a :class:`Dump`; any problem raises
:class:`DumpError`, whose message names the file and the key. Loading never writes to the input.

The package: :mod:`.model` (the key catalogue and :class:`Dump`), :mod:`.read` (the three
containers, bounded), :mod:`.check` (the one checker, :func:`validate` and :func:`load`),
:mod:`.write` (:func:`save`).
"""

from .check import MAX_BLOCK_SIZE, load, validate
from .model import (
    DUMP_VERSION,
    INT64_KEYS,
    KNOWN_KEYS,
    REAL_KV_PREFIX,
    REQUIRED_KEYS,
    STRING_KEYS,
    SYNTH_KEY_PREFIX,
    USER_KEY_PREFIX,
    VERSION_KEY,
    Dump,
    DumpError,
    check_key_names,
    flavour_of,
    widen,
)
from .read import MAX_NPZ_EXPANSION, MAX_NPZ_EXPANSION_FLOOR, MAX_SAFETENSORS_HEADER, read_raw
from .write import CONTAINER_SUFFIXES, container_for, save

__all__ = [
    "CONTAINER_SUFFIXES", "DUMP_VERSION", "INT64_KEYS", "KNOWN_KEYS", "MAX_BLOCK_SIZE",
    "MAX_NPZ_EXPANSION", "MAX_NPZ_EXPANSION_FLOOR", "MAX_SAFETENSORS_HEADER", "REAL_KV_PREFIX",
    "REQUIRED_KEYS", "STRING_KEYS", "SYNTH_KEY_PREFIX", "USER_KEY_PREFIX", "VERSION_KEY", "Dump",
    "DumpError", "check_key_names", "container_for", "flavour_of", "load", "read_raw", "save",
    "validate", "widen",
]
