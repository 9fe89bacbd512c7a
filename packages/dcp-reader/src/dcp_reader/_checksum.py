"""Block checksums of stored chunks: XXH3-64 of every fixed-size block of a chunk's bytes.

Recorded in ``ChunkMeta.checksum`` as ``"xxh3-64/4194304:<hex>,<hex>,..."``: the algorithm,
the block size in bytes, then one 16-digit hex digest per block (the last block may be
shorter; a chunk of 0 bytes has none). A read verifies only the blocks it touches, so a
narrowed read of a large chunk checks a few blocks, not the whole chunk.

4 MiB blocks: narrowed reads over-read at most one block at each end of their byte range,
and a digest costs 17 bytes of metadata per 4 MiB (a 1 TB checkpoint: ~4 MB of digests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._errors import ChecksumError, MetadataError

ALGORITHM = "xxh3-64"
BLOCK_BYTES = 4 * 1024 * 1024


def _xxh3(data: Any) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(data)


def block_digests(raw: Any, block: int = BLOCK_BYTES) -> str:
    """The checksum string of the bytes ``raw`` (any buffer; read, not copied)."""
    view = memoryview(raw).cast("B")
    sums = ",".join(f"{_xxh3(view[i:i + block]):016x}" for i in range(0, len(view), block))
    return f"{ALGORITHM}/{block}:{sums}"


@dataclass
class BlockSums:
    """A parsed checksum string of one chunk of ``nbytes`` bytes, and the blocks verified so
    far by the reader holding it (a block is verified once per reader, not once per read:
    many small boxes of one large chunk would otherwise each read and hash 4 MiB)."""

    block: int
    digests: tuple[int, ...]
    verified: set[int] = field(default_factory=set)

    @classmethod
    def parse(cls, text: str, nbytes: int, *, path: str, key: str | None) -> BlockSums:
        """MetadataError naming ``path`` and ``key`` when ``text`` is malformed, uses an
        algorithm this version does not know, or has the wrong number of digests."""
        try:
            head, _, body = text.partition(":")
            algorithm, _, block_text = head.partition("/")
            block = int(block_text)
            digests = tuple(int(d, 16) for d in body.split(",")) if body else ()
            ok = algorithm == ALGORITHM and block > 0 and all(0 <= d < 1 << 64 for d in digests)
        except ValueError:
            ok = False
        if not ok:
            raise MetadataError(f"checksum {text[:80]!r} of {key!r} is not '{ALGORITHM}/<block>:<hex>,...' "
                                "(corrupt metadata, or written by a newer dcp-reader: upgrade it)",
                                path=path, key=key)
        expected = -(-nbytes // block)
        if len(digests) != expected:
            raise MetadataError(f"checksum of {key!r} has {len(digests)} block digest(s) but its {nbytes} "
                                f"bytes make {expected} block(s) of {block}; the metadata is corrupt",
                                path=path, key=key)
        return cls(block, digests)

    def span(self, lo: int, hi: int, nbytes: int) -> tuple[int, int]:
        """The byte range [lo', hi') of whole blocks covering [lo, hi) in a chunk of ``nbytes``."""
        return lo - lo % self.block, min(nbytes, -(-hi // self.block) * self.block)

    def done(self, lo: int, hi: int) -> bool:
        """Whether every block touching [lo, hi) was verified already."""
        return all(i in self.verified for i in range(lo // self.block, -(-hi // self.block)))

    def verify(self, buf: Any, start: int, *, path: str, key: str, name: str) -> None:
        """Check the whole blocks held in ``buf``, which holds the chunk's bytes from
        ``start`` (a block boundary); ChecksumError naming file, tensor, key and block."""
        view = memoryview(buf).cast("B")
        first = start // self.block
        for i in range(first, first + -(-len(view) // self.block)):
            lo = i * self.block - start
            got = _xxh3(view[lo:lo + self.block])
            if got != self.digests[i]:
                raise ChecksumError(
                    f"block {i} (bytes [{i * self.block}, {i * self.block + len(view[lo:lo + self.block])}) "
                    f"of key {key!r}) of tensor {name!r} has {ALGORITHM} {got:016x} but {self.digests[i]:016x} "
                    "was recorded when it was saved: the file is corrupt (storage or copy error). Re-copy "
                    "or re-save the checkpoint", path=path, key=name)
            self.verified.add(i)
