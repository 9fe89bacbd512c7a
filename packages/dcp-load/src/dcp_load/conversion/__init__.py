"""Offline conversion: a load into preallocated output files, and `read_state_dict`. Imports `_load` and the layers below it."""

__all__: list[str] = []
