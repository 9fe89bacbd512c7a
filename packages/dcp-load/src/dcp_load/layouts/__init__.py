"""The layout layer: destination targets and their boxes (DTensor, ShardedTensor, Chunk, Flat), `sources=` compositions and aliases, key matching. Imports only dcp-reader, dcp-platform and `_errors`."""

__all__: list[str] = []
