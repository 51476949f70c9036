"""Block (de)serialisation for every tier outside process memory: header, checksum, optional lz4.

A stored block is ``header ‖ payload``. The header is self-describing (magic, version, layout
fingerprint, namespace fingerprint, key, lengths, checksum) so a reader can tell, before trusting a
single payload byte, that the value is a complete kvtier block of the expected key, layout and
namespace — a block of another model of the same shape, or of another tensor-parallel rank (engine
hashes are equal on every rank), that lands under our key name is refused, not served. The checksum (xxh3-64)
covers the header and the stored payload. Any mismatch raises :class:`CorruptBlock`, which tiers
turn into a miss. Lengths are validated against the expected layout before anything is allocated.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import lz4.block
import numpy as np
import xxhash

from kvtier.blocks import BlockKey
from kvtier.errors import CorruptBlock

MAGIC = b"KVTB"
#: 2: the namespace fingerprint joined the header (version-1 blocks are refused, i.e. misses).
VERSION = 2
FLAG_LZ4 = 1
FLAG_SHUFFLE = 2
MAX_HASH_BYTES = 64
#: Stored raw when compression saves less than this ratio.
MIN_COMPRESSION_RATIO = 1.05

_FIXED = struct.Struct("<4sHHQIHHQQQ")
#: Bytes of every header: the fixed fields, the block hash (padded), the namespace fingerprint and
#: reserved space.
HEADER_SIZE = 128
_CHECKSUM_OFFSET = _FIXED.size - 8
#: where a header's little-endian xxh3-64 checksum sits (native readers compare around it)
CHECKSUM_OFFSET = _CHECKSUM_OFFSET
_NAMESPACE = struct.Struct("<Q")
_NAMESPACE_OFFSET = _FIXED.size + MAX_HASH_BYTES



@dataclass(frozen=True)
class BlockHeader:
    key: BlockKey
    layout_fingerprint: int
    namespace_fingerprint: int
    flags: int
    raw_len: int
    payload_len: int
    checksum: int

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_LZ4)


def _pack_header(key: BlockKey, layout_fp: int, namespace_fp: int, flags: int, raw_len: int, payload_len: int,
                 checksum: int) -> bytearray:
    if len(key.block_hash) > MAX_HASH_BYTES:
        raise ValueError(f"block hash of {len(key.block_hash)} bytes exceeds {MAX_HASH_BYTES}")
    buf = bytearray(HEADER_SIZE)
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, flags, layout_fp, key.group_id, len(key.block_hash), 0,
                     raw_len, payload_len, checksum)
    buf[_FIXED.size:_FIXED.size + len(key.block_hash)] = key.block_hash
    _NAMESPACE.pack_into(buf, _NAMESPACE_OFFSET, namespace_fp)
    return buf


def _checksum(header_zeroed: bytes | bytearray | memoryview, payload: object) -> int:
    h = xxhash.xxh3_64()
    h.update(header_zeroed)
    h.update(payload)  # type: ignore[arg-type]
    return h.intdigest()


def shuffle_bytes(raw: memoryview | np.ndarray, itemsize: int) -> np.ndarray:
    """Group byte *k* of every element together (helps lz4 on fp16/bf16 mantissa noise)."""
    arr = np.frombuffer(raw, dtype=np.uint8)
    return np.ascontiguousarray(arr.reshape(-1, itemsize).T).reshape(-1)


def unshuffle_bytes_into(shuffled: bytes | memoryview, itemsize: int, out: np.ndarray) -> None:
    """Inverse of :func:`shuffle_bytes`. 16-bit elements (fp16/bf16) take a shift-and-or path that is
    ~10× faster than the generic strided transpose (0.3 vs 3.5 ms per 2 MiB here)."""
    src = np.frombuffer(shuffled, dtype=np.uint8).reshape(itemsize, -1)
    if itemsize == 2 and out.flags.c_contiguous and np.little_endian:
        words = out.view(np.uint16)
        np.left_shift(src[1], 8, out=words, dtype=np.uint16)
        np.bitwise_or(words, src[0], out=words)
        return
    out.reshape(-1, itemsize)[...] = src.T


def encode_block(key: BlockKey, layout_fp: int, raw: memoryview | np.ndarray, *, namespace_fp: int = 0,
                 compress: bool = False, shuffle_itemsize: int = 0) -> tuple[bytearray, memoryview]:
    """Return ``(header, payload)`` for ``raw`` block bytes; payload is ``raw`` itself when stored raw.

    ``namespace_fp`` is :func:`kvtier.hashing.namespace_fingerprint` of the tier's namespace (0: none).

    Two buffers instead of one so writers can ``writev``/pipeline them without concatenating 2 MiB.
    """
    raw_view = memoryview(raw).cast("B")  # type: ignore[arg-type]
    raw_len = raw_view.nbytes
    flags = 0
    payload: memoryview = raw_view
    if compress and raw_len:
        source: object = raw_view
        shuffled = shuffle_itemsize > 1 and raw_len % shuffle_itemsize == 0
        if shuffled:
            source = shuffle_bytes(raw_view, shuffle_itemsize)
        packed = lz4.block.compress(source, store_size=False)
        if len(packed) * MIN_COMPRESSION_RATIO <= raw_len:
            payload = memoryview(packed)
            flags = FLAG_LZ4 | (FLAG_SHUFFLE if shuffled else 0)
    header = _pack_header(key, layout_fp, namespace_fp, flags, raw_len, payload.nbytes, 0)
    checksum = _checksum(header, payload)
    struct.pack_into("<Q", header, _CHECKSUM_OFFSET, checksum)
    return header, payload


def decode_header(buf: bytes | bytearray | memoryview, *, expected_key: BlockKey | None = None,
                  expected_layout: int | None = None, expected_raw_len: int | None = None,
                  expected_namespace: int | None = None) -> BlockHeader:
    """Parse and validate a header; raise :class:`CorruptBlock` naming what is wrong."""
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptBlock(f"truncated header: {view.nbytes} of {HEADER_SIZE} bytes")
    magic, version, flags, layout_fp, group_id, hash_len, _, raw_len, payload_len, checksum = \
        _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise CorruptBlock(f"unsupported block format version {version}")
    if hash_len > MAX_HASH_BYTES:
        raise CorruptBlock(f"hash length {hash_len} exceeds {MAX_HASH_BYTES}")
    key = BlockKey(bytes(view[_FIXED.size:_FIXED.size + hash_len]), group_id)
    if expected_key is not None and key != expected_key:
        raise CorruptBlock(f"header names {key}, expected {expected_key}")
    if expected_layout is not None and layout_fp != expected_layout:
        raise CorruptBlock(
            f"layout fingerprint {layout_fp:016x} differs from expected {expected_layout:016x}")
    (namespace_fp,) = _NAMESPACE.unpack_from(view, _NAMESPACE_OFFSET)
    if expected_namespace is not None and namespace_fp != expected_namespace:
        raise CorruptBlock(f"block of another namespace (fingerprint {namespace_fp:016x}, expected "
                           f"{expected_namespace:016x}): another model or tensor-parallel rank")
    if expected_raw_len is not None and raw_len != expected_raw_len:
        raise CorruptBlock(f"header claims {raw_len} raw bytes, layout has {expected_raw_len}")
    compressed = bool(flags & FLAG_LZ4)
    if (not compressed and payload_len != raw_len) or payload_len > lz4_bound(raw_len):
        raise CorruptBlock(f"payload length {payload_len} impossible for {raw_len} raw bytes")
    return BlockHeader(key, layout_fp, namespace_fp, flags, raw_len, payload_len, checksum)


def lz4_bound(raw_len: int) -> int:
    return raw_len + raw_len // 255 + 16


def verify_payload(header_buf: bytes | bytearray | memoryview, header: BlockHeader,
                   payload: bytes | bytearray | memoryview | np.ndarray) -> None:
    """Check the checksum over header and stored payload; raise :class:`CorruptBlock` on mismatch."""
    pview = memoryview(payload).cast("B")  # type: ignore[arg-type]
    if pview.nbytes != header.payload_len:
        raise CorruptBlock(f"payload has {pview.nbytes} bytes, header says {header.payload_len}")
    running = PayloadChecksum(header_buf, header)
    running.update(pview)
    running.verify()


class PayloadChecksum:
    """:func:`verify_payload` in pieces: feed the payload as it arrives (each piece while it is still in
    the CPU cache, right after a receive wrote it), then :meth:`verify`."""

    __slots__ = ("header", "_hash", "_fed")

    def __init__(self, header_buf: bytes | bytearray | memoryview, header: BlockHeader) -> None:
        zeroed = bytearray(memoryview(header_buf).cast("B")[:HEADER_SIZE])
        zeroed[_CHECKSUM_OFFSET:_CHECKSUM_OFFSET + 8] = bytes(8)
        self.header = header
        self._hash = xxhash.xxh3_64(zeroed)
        self._fed = 0

    def update(self, piece: bytes | bytearray | memoryview | np.ndarray) -> None:
        self._hash.update(piece)  # type: ignore[arg-type]
        self._fed += memoryview(piece).nbytes  # type: ignore[arg-type]

    def verify(self) -> None:
        """Raise :class:`CorruptBlock` unless exactly the header's payload length was fed and matches."""
        if self._fed != self.header.payload_len:
            raise CorruptBlock(f"payload has {self._fed} bytes, header says {self.header.payload_len}")
        if self._hash.intdigest() != self.header.checksum:
            raise CorruptBlock(f"checksum mismatch for {self.header.key}")


class RawHeaders:
    """The headers of uncompressed blocks of one layout and namespace, checksum field zeroed.

    A reader that knows what it expects compares a stored header with :meth:`of` ``(key)`` in one step
    (:func:`verify_raw`) instead of decoding and checking each field. The fixed fields are packed once
    per group and hash length; a key's header is then one ``join``.
    """

    def __init__(self, layout_fp: int, raw_len: int, namespace_fp: int = 0) -> None:
        self.layout_fp, self.raw_len = layout_fp, raw_len
        self._tail = _NAMESPACE.pack(namespace_fp) + bytes(HEADER_SIZE - _NAMESPACE_OFFSET - _NAMESPACE.size)
        self._heads: dict[tuple[int, int], tuple[bytes, bytes]] = {}

    def of(self, key: BlockKey) -> bytes:
        block_hash = key.block_hash
        parts = self._heads.get((key.group_id, len(block_hash)))
        if parts is None:
            packed = _pack_header(key, self.layout_fp, 0, 0, self.raw_len, self.raw_len, 0)
            parts = self._heads[key.group_id, len(block_hash)] = (
                bytes(packed[:_FIXED.size]), bytes(MAX_HASH_BYTES - len(block_hash)))
        return b"".join((parts[0], block_hash, parts[1], self._tail))

    def of_hashes(self, group_id: int, hashes: list[bytes]) -> bytes:
        """:meth:`of` for each hash (all of one length) of ``group_id``, concatenated: one C-level join."""
        if not hashes:
            return b""
        head = self.of(BlockKey(hashes[0], group_id))[:_FIXED.size]
        after = bytes(MAX_HASH_BYTES - len(hashes[0])) + self._tail
        return head + (after + head).join(hashes) + after


def start_raw_check(header_buf: bytes | bytearray | memoryview, expected: bytes) -> xxhash.xxh3_64 | None:
    """Compare a stored header with ``expected`` (:meth:`RawHeaders.of`) byte for byte, checksum aside.

    ``None``: not this exact raw block (the caller decodes the header the long way, with
    :func:`decode_header` and :func:`verify_payload`, to learn why or to read an lz4 block). Else the
    checksum's digest, fed the header: the caller feeds it the payload, in as many pieces as it reads
    (each while it is still in the CPU cache), then asks :func:`finish_raw_check`.
    """
    view = memoryview(header_buf)
    if view[:_CHECKSUM_OFFSET] != expected[:_CHECKSUM_OFFSET] or \
            view[_CHECKSUM_OFFSET + 8:HEADER_SIZE] != expected[_CHECKSUM_OFFSET + 8:]:
        return None
    return xxhash.xxh3_64(expected)


def finish_raw_check(header_buf: bytes | bytearray | memoryview, digest: xxhash.xxh3_64) -> bool:
    """Whether ``digest`` (header and payload fed) is the checksum the stored header carries."""
    stored = memoryview(header_buf)[_CHECKSUM_OFFSET:_CHECKSUM_OFFSET + 8]
    return digest.intdigest() == int.from_bytes(stored, "little")


def verify_raw(header_buf: bytes | bytearray | memoryview, expected: bytes,
               payload: bytes | bytearray | memoryview | np.ndarray) -> bool:
    """Whether ``header_buf`` is ``expected`` and its checksum covers ``payload`` (one buffer).

    Every header byte is compared, so a ``True`` checks as much as :func:`decode_header` and
    :func:`verify_payload` do; a ``False`` says only "not this exact raw block".
    """
    digest = start_raw_check(header_buf, expected)
    if digest is None:
        return False
    digest.update(payload)  # type: ignore[arg-type]
    return finish_raw_check(header_buf, digest)


def decode_payload_into(header: BlockHeader, payload: bytes | bytearray | memoryview, out: np.ndarray,
                        itemsize: int) -> None:
    """Write the raw block bytes of a verified payload into ``out`` (a uint8 array of ``raw_len``)."""
    if out.nbytes != header.raw_len:
        raise CorruptBlock(f"destination has {out.nbytes} bytes, block has {header.raw_len}")
    if not header.compressed:
        if np.shares_memory(out, np.frombuffer(payload, dtype=np.uint8)):
            return
        out[...] = np.frombuffer(payload, dtype=np.uint8)
        return
    try:
        raw = lz4.block.decompress(payload, uncompressed_size=header.raw_len)
    except lz4.block.LZ4BlockError as exc:
        raise CorruptBlock(f"lz4 payload of {header.key} does not decompress: {exc}") from exc
    if len(raw) != header.raw_len:
        raise CorruptBlock(f"lz4 payload of {header.key} decompressed to {len(raw)} bytes")
    if header.flags & FLAG_SHUFFLE:
        unshuffle_bytes_into(raw, itemsize, out)
    else:
        out[...] = np.frombuffer(raw, dtype=np.uint8)


def decode_block_into(value: bytes | bytearray | memoryview, out: np.ndarray, *, expected_key: BlockKey,
                      expected_layout: int, itemsize: int, expected_namespace: int | None = None) -> None:
    """Validate a whole ``header ‖ payload`` value and write its raw bytes into ``out``."""
    view = memoryview(value).cast("B")
    header = decode_header(view, expected_key=expected_key, expected_layout=expected_layout,
                           expected_raw_len=out.nbytes, expected_namespace=expected_namespace)
    if view.nbytes != HEADER_SIZE + header.payload_len:
        raise CorruptBlock(f"value of {view.nbytes} bytes, header says {HEADER_SIZE + header.payload_len}")
    payload = view[HEADER_SIZE:]
    verify_payload(view, header, payload)
    decode_payload_into(header, payload, out, itemsize)
