"""Saving: the native format written once per distinct box, with an atomic commit. Imports `_load`, `run`, `plan`, `layouts`."""

__all__: list[str] = []
