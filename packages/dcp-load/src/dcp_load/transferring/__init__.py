"""The transfer layer: moving live tensors from one layout to another between ranks, with no storage (``dcp_load.transfer``). Imports `_load`, `run`, `plan`, `layouts` and below."""

__all__: list[str] = []
