from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.hashing import HASH_BYTES, Namespace, hash_token_blocks

NS = Namespace("model-a", "float16", 0x1234, 0, 1)


def test_hashes_are_stable_across_runs() -> None:
    first = hash_token_blocks(list(range(64)), 16, NS)
    assert first == hash_token_blocks(np.arange(64, dtype=np.int32), 16, NS)
    assert len(first) == 4 and all(len(h) == HASH_BYTES for h in first)
    assert NS.id == Namespace("model-a", "float16", 0x1234, 0, 1).id


@given(common=st.lists(st.integers(0, 50_000), max_size=80), a=st.lists(st.integers(0, 50_000), max_size=40),
       b=st.lists(st.integers(0, 50_000), max_size=40))
def test_equal_hash_iff_equal_prefix(common: list[int], a: list[int], b: list[int]) -> None:
    ha = hash_token_blocks(common + a, 8, NS)
    hb = hash_token_blocks(common + b, 8, NS)
    ta, tb = common + a, common + b
    for i in range(min(len(ha), len(hb))):
        assert (ha[i] == hb[i]) == (ta[: (i + 1) * 8] == tb[: (i + 1) * 8])


def test_namespaces_never_share_keys() -> None:
    tokens = list(range(32))
    others = [Namespace("model-b", "float16", 0x1234), Namespace("model-a", "bfloat16", 0x1234),
              Namespace("model-a", "float16", 0x9999), Namespace("model-a", "float16", 0x1234, 1, 2)]
    base = set(hash_token_blocks(tokens, 16, NS))
    for ns in others:
        assert base.isdisjoint(hash_token_blocks(tokens, 16, ns))


def test_extra_keys_change_the_chain() -> None:
    tokens = list(range(32))
    assert hash_token_blocks(tokens, 16, NS, ["lora-1"]) != hash_token_blocks(tokens, 16, NS)


def test_partial_trailing_block_is_not_hashed_and_bad_input_is_named() -> None:
    assert len(hash_token_blocks(list(range(31)), 16, NS)) == 1
    with pytest.raises(ValueError, match="one-dimensional"):
        hash_token_blocks(np.zeros((2, 16), dtype=np.int64), 16, NS)
    with pytest.raises(ValueError, match="integers"):
        hash_token_blocks(np.zeros(16, dtype=np.float32), 16, NS)
