"""Checksums: block hashing (in a worker thread), value checksums, and `verify_checkpoint`. Imports `storage`, `formats` and the model."""

__all__: list[str] = []
