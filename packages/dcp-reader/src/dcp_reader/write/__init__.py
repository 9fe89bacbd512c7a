"""Writing the native format: data files with block checksums, values, and the writer lock. Imports `storage`, `formats` and the model."""

__all__: list[str] = []
