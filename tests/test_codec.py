from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.codec import (
    HEADER_SIZE,
    PayloadChecksum,
    RawHeaders,
    decode_block_into,
    decode_header,
    encode_block,
    verify_payload,
    verify_raw,
)
from kvtier.errors import CorruptBlock

KEY = BlockKey(b"\xab" * 32, 2)
LAYOUT = 0xDEADBEEF


def value(raw: np.ndarray, **kw: object) -> bytes:
    header, payload = encode_block(KEY, LAYOUT, raw, **kw)  # type: ignore[arg-type]
    return bytes(header) + bytes(payload)


def decode(buf: bytes, n: int, key: BlockKey = KEY, layout: int = LAYOUT) -> np.ndarray:
    out = np.empty(n, dtype=np.uint8)
    decode_block_into(buf, out, expected_key=key, expected_layout=layout, itemsize=2)
    return out


@given(data=st.binary(min_size=2, max_size=4096).filter(lambda b: len(b) % 2 == 0), compress=st.booleans())
def test_round_trip_is_bit_exact(data: bytes, compress: bool) -> None:
    raw = np.frombuffer(data, dtype=np.uint8)
    assert decode(value(raw, compress=compress, shuffle_itemsize=2), raw.size).tobytes() == data


def test_compressible_data_is_compressed_and_noise_is_stored_raw() -> None:
    smooth = np.zeros(65536, dtype=np.float16)
    smooth[::7] = 1.5
    raw = smooth.view(np.uint8)
    header, payload = encode_block(KEY, LAYOUT, raw, compress=True, shuffle_itemsize=2)
    assert payload.nbytes < raw.size // 4
    assert decode(bytes(header) + bytes(payload), raw.size).tobytes() == raw.tobytes()
    noise = np.random.default_rng(0).integers(0, 256, 65536, dtype=np.uint8)
    assert encode_block(KEY, LAYOUT, noise, compress=True)[1].nbytes == noise.size


@settings(max_examples=60)
@given(position=st.integers(0, HEADER_SIZE + 255), flip=st.integers(1, 255), compress=st.booleans())
def test_any_flipped_byte_is_detected(position: int, flip: int, compress: bool) -> None:
    raw = np.tile(np.arange(128, dtype=np.uint8), 2)
    buf = bytearray(value(raw, compress=compress))
    if position >= len(buf):
        position %= len(buf)
    buf[position] ^= flip
    try:
        out = decode(bytes(buf), raw.size)
    except CorruptBlock:
        return
    # only the zero padding of the header (unused hash bytes) may change without effect on the data
    assert out.tobytes() == raw.tobytes()


def test_wrong_key_layout_or_length_is_a_corrupt_block() -> None:
    raw = np.arange(256, dtype=np.uint8)
    buf = value(raw)
    with pytest.raises(CorruptBlock, match="expected"):
        decode(buf, 256, key=BlockKey(b"\xab" * 32, 3))
    with pytest.raises(CorruptBlock, match="layout fingerprint"):
        decode(buf, 256, layout=1)
    with pytest.raises(CorruptBlock, match="raw bytes"):
        decode(buf, 128)
    with pytest.raises(CorruptBlock, match="truncated|value of"):
        decode(buf[: HEADER_SIZE - 1], 256)
    with pytest.raises(CorruptBlock, match="value of"):
        decode(buf[:-1], 256)


def test_huge_claimed_length_is_rejected_before_allocation() -> None:
    raw = np.arange(256, dtype=np.uint8)
    header, _ = encode_block(KEY, LAYOUT, raw)
    forged = bytearray(header)
    forged[32:40] = (1 << 60).to_bytes(8, "little")  # payload_len
    with pytest.raises(CorruptBlock):
        decode_header(forged, expected_raw_len=256)


@settings(max_examples=50)
@given(ours=st.text(min_size=1, max_size=40), theirs=st.text(min_size=1, max_size=40))
def test_a_block_of_another_namespace_is_refused(ours: str, theirs: str) -> None:
    """The namespace fingerprint is in the (checksummed) header and checked on every read."""
    from kvtier.hashing import namespace_fingerprint

    raw = np.arange(256, dtype=np.uint8)
    buf = value(raw, namespace_fp=namespace_fingerprint(theirs))
    out = np.empty(256, dtype=np.uint8)
    if ours == theirs:
        decode_block_into(buf, out, expected_key=KEY, expected_layout=LAYOUT, itemsize=2,
                          expected_namespace=namespace_fingerprint(ours))
        assert out.tobytes() == raw.tobytes()
        assert decode_header(buf).namespace_fingerprint == namespace_fingerprint(theirs)
    else:
        with pytest.raises(CorruptBlock, match="another namespace"):
            decode_block_into(buf, out, expected_key=KEY, expected_layout=LAYOUT, itemsize=2,
                              expected_namespace=namespace_fingerprint(ours))


def test_a_version_1_block_is_refused() -> None:
    """Blocks written before the namespace joined the header carry no fingerprint: misses, not ours."""
    buf = bytearray(value(np.arange(256, dtype=np.uint8)))
    buf[4:6] = (1).to_bytes(2, "little")
    with pytest.raises(CorruptBlock, match="version 1"):
        decode(bytes(buf), 256)


def test_namespace_fingerprint_follows_the_namespace_object() -> None:
    from kvtier.hashing import Namespace

    a = Namespace("m", "float16", 1, tp_rank=0, tp_size=2)
    assert a.fingerprint == Namespace("m", "float16", 1, tp_rank=0, tp_size=2).fingerprint
    assert len({a.fingerprint, Namespace("m", "float16", 1, tp_rank=1, tp_size=2).fingerprint,
                Namespace("n", "float16", 1, tp_rank=0, tp_size=2).fingerprint}) == 3


@given(data=st.binary(min_size=2, max_size=4096).filter(lambda b: len(b) % 2 == 0),
       cuts=st.lists(st.integers(0, 4096), max_size=5), flip=st.one_of(st.none(), st.integers(0, 4095)))
@settings(max_examples=80)
def test_payload_checksum_in_pieces_agrees_with_verify_payload(data: bytes, cuts: list[int],
                                                               flip: int | None) -> None:
    header_buf, payload = encode_block(KEY, LAYOUT, np.frombuffer(data, dtype=np.uint8))
    received = bytearray(payload)
    if flip is not None and flip < len(received):
        received[flip] ^= 1
    header = decode_header(header_buf)
    bounds = sorted({0, len(received), *(c for c in cuts if c <= len(received))})
    running = PayloadChecksum(header_buf, header)
    for start, end in zip(bounds, bounds[1:], strict=False):
        running.update(memoryview(received)[start:end])
    try:
        verify_payload(header_buf, header, received)
    except CorruptBlock:
        with pytest.raises(CorruptBlock, match="checksum"):
            running.verify()
        assert received != payload
    else:
        running.verify()
        assert received == payload


def test_payload_checksum_refuses_a_short_payload() -> None:
    header_buf, payload = encode_block(KEY, LAYOUT, np.arange(64, dtype=np.uint8))
    running = PayloadChecksum(header_buf, decode_header(header_buf))
    running.update(payload[:63])
    with pytest.raises(CorruptBlock, match="63 bytes"):
        running.verify()
def _long_way_accepts(header: bytes, payload: bytes, key: BlockKey, layout: int, raw_len: int,
                      ns: int) -> bool:
    try:
        decoded = decode_header(header, expected_key=key, expected_layout=layout, expected_raw_len=raw_len,
                                expected_namespace=ns)
        verify_payload(header, decoded, payload)
    except CorruptBlock:
        return False
    return not decoded.compressed


@settings(max_examples=150)
@given(block_hash=st.binary(max_size=64), group=st.integers(0, 2**32 - 1), ns=st.integers(0, 2**64 - 1),
       data=st.binary(min_size=2, max_size=2048).filter(lambda b: len(b) % 2 == 0), compress=st.booleans(),
       position=st.integers(-1, HEADER_SIZE + 2047), flip=st.integers(1, 255),
       other_key=st.booleans(), other_ns=st.booleans())
def test_the_one_step_raw_check_agrees_with_the_field_by_field_one(
        block_hash: bytes, group: int, ns: int, data: bytes, compress: bool, position: int, flip: int,
        other_key: bool, other_ns: bool) -> None:
    """``verify_raw`` accepts exactly the raw blocks that ``decode_header`` + ``verify_payload`` accept
    (an lz4 block it leaves to them), whatever byte was damaged, and refuses another key or namespace."""
    key = BlockKey(block_hash, group)
    raw = np.frombuffer(data, dtype=np.uint8)
    header, payload = encode_block(key, LAYOUT, raw, namespace_fp=ns, compress=compress, shuffle_itemsize=2)
    stored = bytearray(bytes(header) + bytes(payload))
    if 0 <= position < len(stored):
        stored[position] ^= flip
    stored_header, stored_payload = bytes(stored[:HEADER_SIZE]), bytes(stored[HEADER_SIZE:])
    expected_key = BlockKey(block_hash + b"x", group) if other_key and len(block_hash) < 64 else key
    expected_ns = ns ^ 1 if other_ns else ns
    expected = RawHeaders(LAYOUT, raw.size, expected_ns).of(expected_key)
    fast = verify_raw(stored_header, expected, stored_payload)
    long_way = _long_way_accepts(stored_header, stored_payload, expected_key, LAYOUT, raw.size, expected_ns)
    assert fast == long_way
    if fast:
        assert stored_payload == data


@given(length=st.integers(0, 64), count=st.integers(0, 6), group=st.integers(0, 2**32 - 1),
       ns=st.integers(0, 2**64 - 1), seed=st.binary(min_size=1, max_size=8))
def test_a_batch_of_raw_headers_is_the_headers_of_each_key(length: int, count: int, group: int, ns: int,
                                                            seed: bytes) -> None:
    """``of_hashes`` (the native reader's batch) is ``of`` of each key, end to end."""
    hashes = [(seed * 80)[i:i + length] if i % 2 else bytes([i]) * length for i in range(count)]
    headers = RawHeaders(LAYOUT, 512, ns)
    assert headers.of_hashes(group, hashes) == b"".join(headers.of(BlockKey(h, group)) for h in hashes)
