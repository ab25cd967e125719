"""The :class:`~kvcanary.format.consts.FailReason` bits as plain ``int``, declared once: what
the reference, the diagnosis and the scorers mask int64 ring fields and numpy arrays with.
Modules import the ones they use."""

from .consts import FailReason

VERIFY_CHAIN_HASH_MISMATCH = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
VERIFY_POSITION_MISMATCH = int(FailReason.VERIFY_POSITION_MISMATCH)
VERIFY_REAL_KV_HASH_MISMATCH = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
WRITE_TOKEN_MISMATCH = int(FailReason.WRITE_TOKEN_MISMATCH)
WRITE_POSITION_MISMATCH = int(FailReason.WRITE_POSITION_MISMATCH)
VERIFY_TOKEN_MISMATCH = int(FailReason.VERIFY_TOKEN_MISMATCH)
SLOT_OUT_OF_RANGE = int(FailReason.SLOT_OUT_OF_RANGE)
SLOT_ZERO_IN_PREFIX = int(FailReason.SLOT_ZERO_IN_PREFIX)
WRITE_SLOT_CONFLICT = int(FailReason.WRITE_SLOT_CONFLICT)
# Either write check.
WRITE_MISMATCH = WRITE_TOKEN_MISMATCH | WRITE_POSITION_MISMATCH
