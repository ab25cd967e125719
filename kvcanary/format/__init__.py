"""The canary format: the facts every layer shares and nothing else.

``consts`` (the format's constants and enums, kept equal to ``kernels/kvc_consts.cuh`` by a
test), ``errors`` (the one error family), ``hashing`` (SplitMix64 and the chain link),
``rules`` (the rules the reference, the audit and the tools read from one place) and
``violations`` (a decoded ring row and its renderings).

The lowest layer: it imports no other part of kvcanary."""
