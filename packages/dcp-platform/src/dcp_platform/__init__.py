"""dcp-platform: one object per backend for collectives, groups, fused copy and allocation."""

from ._base import Capabilities, Handle, Platform
from ._scope import group_key
from ._select import ENV_VAR, PLATFORM_NAMES, get_platform, platform_name
from ._version import __version__
from ._watch import HEARTBEAT_S, HEARTBEAT_THREAD, STALE_S, PeerFailure, Watch
from .codec import ControlMessageError

__all__ = [
    "ENV_VAR",
    "HEARTBEAT_S",
    "HEARTBEAT_THREAD",
    "PLATFORM_NAMES",
    "STALE_S",
    "Capabilities",
    "ControlMessageError",
    "Handle",
    "PeerFailure",
    "Platform",
    "Watch",
    "__version__",
    "get_platform",
    "group_key",
    "platform_name",
]
