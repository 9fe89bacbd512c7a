"""The control-message codec (``_messages``): what other packages use to write and read control
messages through a key-value store, never pickle."""

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

__all__ = ["MAX_MESSAGE_BYTES", "PREFIX", "ControlMessageError", "decode", "decode_failures", "decode_ints",
           "decode_strings", "encode", "encode_failures"]
