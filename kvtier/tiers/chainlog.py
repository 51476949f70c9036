"""Chain links of a persistent tier, so chain-aware eviction survives a restart.

A block file holds one block; which block came before it in its prefix chain is metadata the
cache learns at store time (:attr:`~kvtier.policy.base.InsertHint.predecessor`). A file tier keeps
those links in one append-only log beside its block tree (``<root>/<namespace>/chains.log``), kept
apart from the block header on purpose: a link is advice for eviction, never needed to read a block.

Record: ``u32 crc32 | u16 group | u8 len(hash) | u8 len(predecessor hash) | hash | predecessor``,
the CRC over everything after it. Loading stops at the first torn or corrupt record (a crash mid
append) and drops what follows; the last record of a key wins. The log is rewritten compactly at
load when it holds more than twice the records it needs. Losing the log loses only chain order.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Container, Iterable
from pathlib import Path

from kvtier.blocks import BlockKey

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<IHBB")
FILE_NAME = "chains.log"


def _record(key: BlockKey, pred: BlockKey) -> bytes:
    body = _HEAD.pack(0, key.group_id, len(key.block_hash), len(pred.block_hash))[4:] + key.block_hash + \
        pred.block_hash
    return struct.pack("<I", zlib.crc32(body)) + body


class ChainLog:
    """Append-only (key → predecessor) links of one tier; thread-safe appends."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def load(self, present: Container[BlockKey] | None = None) -> dict[BlockKey, BlockKey]:
        """The links of ``present`` keys (all if None); compacts the log if it is mostly stale."""
        links: dict[BlockKey, BlockKey] = {}
        records = 0
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return links
        except OSError as exc:
            log.warning("chain log %s unreadable (%s): chains start afresh", self.path, exc.strerror)
            return links
        pos, end = 0, len(data)
        while pos + _HEAD.size <= end:
            crc, group, hlen, plen = _HEAD.unpack_from(data, pos)
            stop = pos + _HEAD.size + hlen + plen
            if not hlen or not plen or stop > end or zlib.crc32(data[pos + 4:stop]) != crc:
                break
            key_hash = data[pos + _HEAD.size:pos + _HEAD.size + hlen]
            links[BlockKey(key_hash, group)] = BlockKey(data[stop - plen:stop], group)
            records += 1
            pos = stop
        if pos != end:
            log.warning("chain log %s: %d torn or corrupt bytes after %d records dropped",
                        self.path, end - pos, records)
        if present is not None:
            links = {k: p for k, p in links.items() if k in present}
        if pos != end or records > 2 * len(links) + 1024:
            self._rewrite(links)
        return links

    def append(self, links: Iterable[tuple[BlockKey, BlockKey]]) -> None:
        """Record links (one write per call); an I/O error is logged, never raised."""
        payload = b"".join(_record(k, p) for k, p in links
                           if k.group_id == p.group_id
                           and 0 < len(k.block_hash) < 256 and 0 < len(p.block_hash) < 256)
        if not payload:
            return
        try:
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, payload)
                finally:
                    os.close(fd)
        except OSError as exc:
            log.warning("chain log %s: append failed (%s); chain order of these blocks is lost on restart",
                        self.path, exc.strerror)

    def _rewrite(self, links: dict[BlockKey, BlockKey]) -> None:
        tmp = self.path.with_name(self.path.name + ".compact")
        try:
            with self._lock:
                tmp.write_bytes(b"".join(_record(k, p) for k, p in links.items()))
                os.chmod(tmp, 0o600)
                os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("chain log %s: compaction failed (%s)", self.path, exc.strerror)
