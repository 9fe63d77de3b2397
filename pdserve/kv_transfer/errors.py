"""Exceptions of the KV-exchange library.

Every failure names what differs between the two sides and how to fix it:
KV that is silently wrong produces plausible wrong text, the most expensive bug.
"""


class KVTransferError(Exception):
    """Base class of every error raised by pdserve.kv_transfer."""


class AlignmentError(KVTransferError):
    """The two sides cannot be aligned (layers, heads, pools, block sizes...).

    The message names the mismatching quantity on both sides.
    """


class SchemaError(KVTransferError):
    """Serialized bytes have another version or an unexpected schema."""
