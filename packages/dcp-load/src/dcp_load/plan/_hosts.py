"""Which ranks share a page cache: the key the ``"auto"`` broadcast mode groups ranks by."""

from __future__ import annotations

import os
import socket

__all__ = ["HOST_ID_ENV", "host_id"]

#: Overrides the detected host, e.g. to treat ranks of one machine as separate nodes.
HOST_ID_ENV = "DCP_HOST_ID"

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """An id equal on ranks that run on one kernel under one host name.

    Such ranks share the kernel's page cache, so a box they all want is fetched from storage
    once however many of them read it. Containers of one machine with different host names
    count as different hosts: the conservative side, since they may mount different storage.
    """
    override = os.environ.get(HOST_ID_ENV)
    if override:
        return override
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: the host name alone
        boot = ""
    return f"{socket.gethostname()}/{boot}"
