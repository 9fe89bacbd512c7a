"""Block checksums of stored chunks: XXH3-64 of every fixed-size block of a chunk's bytes.

Recorded in ``ChunkMeta.checksum`` as ``"xxh3-64/4194304:<hex>,<hex>,..."``: the algorithm,
the block size in bytes, then one 16-digit hex digest per block (the last block may be
shorter; a chunk of 0 bytes has none). A read verifies only the blocks it touches, so a
narrowed read of a large chunk checks a few blocks, not the whole chunk.

4 MiB blocks: narrowed reads over-read at most one block at each end of their byte range,
and a digest costs 17 bytes of metadata per 4 MiB (a 1 TB checkpoint: ~4 MB of digests).

``read_verified`` hashes each block as it is read, not after the whole read: a block is
hashed on the reader's ``HashWorker`` thread while the next one is read, or, where that
thread lags (no spare core) and for the last block of a read, in the reading thread right
after each 1 MiB piece of it is read, while the piece is in the CPU cache. Hashing a block
after a 32 MiB read finds it back in DRAM (~11 GB/s on the development machine) instead of
in cache (~20-40 GB/s); see the dcp-reader README, "Measured facts".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._errors import ChecksumError, MetadataError
from ..storage._pread import pread_into
from ._hash_worker import HashWorker, Job

ALGORITHM = "xxh3-64"
BLOCK_BYTES = 4 * 1024 * 1024
# Bytes per preadv call while verifying: small enough that the piece is still in the cache
# when it is hashed (a 4 MiB preadv left it in DRAM: hashing ran at ~10 GB/s after it, ~20
# GB/s after 256 KiB-1 MiB pieces), large enough that the calls cost nothing (one call per
# piece; reading 32 MiB in 256 KiB pieces was as fast as one call).
PIECE_BYTES = 1024 * 1024


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

    def check(self, i: int, got: int, size: int, *, path: str, key: str, name: str) -> None:
        """Record block ``i`` (``size`` bytes) as verified when ``got`` is its digest;
        ChecksumError naming file, tensor, key and block when it is not."""
        if got != self.digests[i]:
            raise ChecksumError(
                f"block {i} (bytes [{i * self.block}, {i * self.block + size}) of key {key!r}) of tensor "
                f"{name!r} has {ALGORITHM} {got:016x} but {self.digests[i]:016x} was recorded when it was "
                "saved: the file is corrupt (storage or copy error). Re-copy or re-save the checkpoint",
                path=path, key=name)
        self.verified.add(i)


def read_verified(fd: int | Any, buf: Any, file_offset: int, start: int, sums: BlockSums, *,
                  worker: HashWorker | None, path: str, key: str, name: str) -> None:
    """Fill ``buf`` with the chunk's bytes from ``start`` (a block boundary), found at
    ``file_offset`` in the file, and verify every block not verified yet before returning
    (ChecksumError naming file, tensor, key and the first bad block; the bytes are then in
    ``buf`` but must not be used).

    A block is handed to ``worker`` once read, to be hashed while the next one is read,
    unless it is the last one of the read (nothing left to overlap) or the worker has not
    started the block before the previous one (no spare core: more would only queue up);
    then each of its pieces is hashed here right after it is read, while in the cache."""
    import xxhash

    view = memoryview(buf).cast("B")
    first = start // sums.block
    if not isinstance(fd, int):
        # An object: one ranged fetch of the whole span (its GETs run in parallel), then
        # each block is hashed; reading piece by piece would cost a round trip per MiB.
        pread_into(fd, view, file_offset, path=path, key=key)
        for lo in range(0, len(view), sums.block):
            if first + lo // sums.block not in sums.verified:
                block = view[lo:lo + sums.block]
                sums.check(first + lo // sums.block, _xxh3(block), len(block), path=path, key=key, name=name)
        return
    todo = [lo for lo in range(0, len(view), sums.block) if first + lo // sums.block not in sums.verified]
    mine: list[tuple[int, int, int]] = []  # (block, digest, size) hashed here
    jobs: list[Job] = []
    try:
        for lo in range(0, len(view), sums.block):
            i = first + lo // sums.block
            block = view[lo:lo + sums.block]
            if i in sums.verified:
                pread_into(fd, block, file_offset + lo, path=path, key=key)
                continue
            hand = (worker is not None and lo != todo[-1]
                    and (len(jobs) < 2 or jobs[-2].started))
            h = None if hand else xxhash.xxh3_64()
            for p in range(0, len(block), PIECE_BYTES):
                piece = block[p:p + PIECE_BYTES]
                pread_into(fd, piece, file_offset + lo + p, path=path, key=key)
                if h is not None:
                    h.update(piece)
            if h is None:
                assert worker is not None
                jobs.append(worker.submit(_digest, i, block))
            else:
                mine.append((i, h.intdigest(), len(block)))
    finally:
        theirs = HashWorker.finish(jobs)  # also after a failed read: no job outlives the call
    for i, got, size in sorted(mine + theirs):
        sums.check(i, got, size, path=path, key=key, name=name)


def _digest(i: int, block: Any) -> tuple[int, int, int]:
    return i, _xxh3(block), len(block)
