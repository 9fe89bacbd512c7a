"""The control-message codec (``_messages``): what other packages use to write and read control
messages through a key-value store (``_messages``) and to exchange plain data between the
ranks of a process group (``_values``), never pickle."""

from ._messages import (
    MAX_MESSAGE_BYTES,
    PREFIX,
    ControlMessageError,
    decode,
    decode_failures,
    decode_ints,
    decode_strings,
    encode,
    encode_failures,
)
from ._values import (
    MAX_VALUE_BYTES,
    UnsendableValueError,
    ValueMessageError,
    check_lengths,
    pack,
    pack_or_refusal,
    unpack,
    unpack_gathered,
)

__all__ = ["MAX_MESSAGE_BYTES", "PREFIX", "ControlMessageError", "decode", "decode_failures", "decode_ints",
           "decode_strings", "encode", "encode_failures", "MAX_VALUE_BYTES", "UnsendableValueError", "ValueMessageError",
           "check_lengths", "pack", "pack_or_refusal", "unpack", "unpack_gathered"]
