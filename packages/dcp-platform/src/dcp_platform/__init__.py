"""dcp-platform: one object per backend for collectives, groups, fused copy and allocation."""

from ._base import Capabilities, Handle, Platform
from ._select import ENV_VAR, PLATFORM_NAMES, get_platform, platform_name
from ._version import __version__

__all__ = [
    "ENV_VAR",
    "PLATFORM_NAMES",
    "Capabilities",
    "Handle",
    "Platform",
    "__version__",
    "get_platform",
    "platform_name",
]
