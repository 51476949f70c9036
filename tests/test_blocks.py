from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.blocks import BlockKey, KVCacheSpec, KVGroup, resolve_block_size_factor
from kvtier.errors import KVTierConfigError
from kvtier.layout import BlockLayout


def spec_for(hash_block: int, gpu_sizes: list[int], block_size: int | None) -> KVCacheSpec:
    factor = resolve_block_size_factor(gpu_sizes, hash_block, block_size)
    groups = tuple(KVGroup(i, size, BlockLayout(1, 1, 8, size * factor)) for i, size in enumerate(gpu_sizes))
    return KVCacheSpec(hash_block, groups, factor)


def test_block_key_is_a_cheap_hashable_value() -> None:
    a, b = BlockKey(b"\x01" * 32, 3), BlockKey(b"\x01" * 32, 3)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != BlockKey(b"\x01" * 32, 4)
    with pytest.raises(AttributeError):
        a.group_id = 5  # type: ignore[misc]


@given(hash_block=st.sampled_from([1, 4, 16]), mults=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       n_hashes=st.integers(0, 40))
def test_each_group_is_keyed_by_the_last_hash_block_it_covers(hash_block: int, mults: list[int],
                                                                n_hashes: int) -> None:
    spec = spec_for(hash_block, [m * hash_block for m in mults], None)
    hashes = [i.to_bytes(8, "little") for i in range(n_hashes)]
    keys = spec.block_keys(hashes)
    for g, m in zip(spec.groups, mults, strict=True):
        assert len(keys[g.group_id]) == n_hashes // m
        for j, key in enumerate(keys[g.group_id]):
            assert key == BlockKey(hashes[(j + 1) * m - 1], g.group_id)


@given(gpu_mult=st.integers(1, 4), factor=st.integers(1, 4), n_hashes=st.integers(0, 64))
def test_block_size_factor_groups_gpu_blocks(gpu_mult: int, factor: int, n_hashes: int) -> None:
    hash_block = 16
    gpu = gpu_mult * hash_block
    spec = spec_for(hash_block, [gpu, gpu], gpu * factor)
    assert spec.block_size_factor == factor
    per_key = gpu_mult * factor
    hashes = [i.to_bytes(8, "little") for i in range(n_hashes)]
    for keys in spec.block_keys(hashes).values():
        assert [k.block_hash for k in keys] == hashes[per_key - 1::per_key]


def test_block_size_needs_one_shared_gpu_block_size() -> None:
    with pytest.raises(KVTierConfigError, match="different GPU block sizes"):
        resolve_block_size_factor([16, 32], 16, 64)


def test_block_size_must_be_a_multiple_of_the_gpu_block_size() -> None:
    with pytest.raises(KVTierConfigError, match="not a multiple of the GPU block size 32"):
        resolve_block_size_factor([32], 16, 48)


def test_gpu_block_size_must_be_a_multiple_of_the_hash_block_size() -> None:
    with pytest.raises(KVTierConfigError, match=r"groups\[1\]\.block_size"):
        resolve_block_size_factor([16, 24], 16, None)


def test_model_without_groups_stores_nothing_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    spec = KVCacheSpec(16, (), 1)
    with caplog.at_level(logging.WARNING):
        assert spec.block_keys([b"x" * 16]) == {}
        assert spec.block_keys([b"y" * 16]) == {}
    assert resolve_block_size_factor([], 16, 64) == 1
