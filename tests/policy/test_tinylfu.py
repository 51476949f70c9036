"""The count-min sketch, and TinyLFU as a tier's admission filter."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.policy.admission import TinyLFUAdmission, make_admission_policy
from kvtier.policy.tinylfu import CountMinSketch, key_hash


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "little"), 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3000), max_size=600))
def test_sketch_never_under_counts_before_aging(refs: list[int]) -> None:
    sketch = CountMinSketch(1 << 16)
    exact: Counter[int] = Counter()
    for i in refs:
        h = key_hash(key(i))
        exact[h] += 1
        assert sketch.increment(h) >= min(exact[h], 15)
    for h, n in exact.items():
        assert sketch.estimate(h) >= min(n, 15)


def test_sketch_halves_after_its_horizon() -> None:
    sketch = CountMinSketch(100)
    h = key_hash(key(1))
    for _ in range(12):
        sketch.increment(h)
    for i in range(2, 90):
        sketch.increment(key_hash(key(i)))
    assert sketch.estimate(h) == 6  # 100 increments: every counter halved once
    assert sketch.estimate(h ^ 0x5A5A5A5A) <= 1  # another key: its counters are (nearly) empty


def test_key_hash_is_stable_and_separates_groups() -> None:
    assert key_hash(BlockKey(b"abc", 0)) == key_hash(BlockKey(b"abc", 0))
    assert key_hash(BlockKey(b"abc", 0)) != key_hash(BlockKey(b"abc", 1))
    assert 0 <= key_hash(BlockKey(b"abc", 0)) < 1 << 32


def test_tinylfu_admission_admits_on_the_second_offer() -> None:
    admission = make_admission_policy("tinylfu", history=1000)
    assert isinstance(admission, TinyLFUAdmission)
    assert not admission.admit(key(1))
    assert admission.admit(key(1))
    assert not admission.admit(key(2))
