"""The numpy reference: upstream's reference semantics, vectorised over entries.

One module per launch (``plan``, ``write``, ``verify``) plus the shared rules
(``realkv`` for the real-KV fold, ``ring`` for the violation ring) and the compiled forms of
the hot loops where numba is installed (``realkv_compiled``, ``chain_compiled``). The CUDA kernels in
``kernels/`` have the same shape and names."""

from types import SimpleNamespace

from .plan import plan_reference
from .verify import verify_reference
from .write import write_reference

__all__ = ["BACKEND", "plan_reference", "verify_reference", "write_reference"]


# The backend interface the API dispatches to (the CUDA backend offers the same three).
BACKEND = SimpleNamespace(plan=plan_reference, write=write_reference, verify=verify_reference)
