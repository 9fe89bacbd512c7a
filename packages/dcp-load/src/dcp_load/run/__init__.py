"""The run layer: executing a plan (reads, staging, broadcasts), coordination between ranks, validation, progress and the load report. Imports `plan`, `layouts` and below."""

__all__: list[str] = []
