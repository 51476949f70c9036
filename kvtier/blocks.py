"""Block keys, KV-cache groups and the hash-block → offloaded-block mapping (vLLM PR #36610 rules).

An engine hashes a request's tokens in *hash blocks* of ``hash_block_size`` tokens; hash *i* is a
chained hash of hash block *i* and hash *i-1*, so equal hashes mean equal whole prefixes. The KV
cache is split into *groups* (attention types / layer sets), each with its own GPU block size, a
multiple of ``hash_block_size``. kvtier stores *offloaded blocks* of
``gpu_block_size × block_size_factor`` tokens, keyed by the hash of the last hash block they cover.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

from kvtier.errors import KVTierConfigError

if TYPE_CHECKING:  # annotations only: config validation and `kvtier check` run without torch
    from kvtier.layout import BlockLayout

log = logging.getLogger(__name__)
_said_no_groups = False


def _warn_no_groups() -> None:
    global _said_no_groups
    if not _said_no_groups:
        _said_no_groups = True
        log.warning("the model has no KV-cache groups (encoder-only?): kvtier stores nothing")


class BlockKey(NamedTuple):
    """Identity of one offloaded block: the hash of the last hash block it covers, and its group.

    A NamedTuple: immutable, hashable and as cheap as a tuple. ``block_hash`` is the engine's own
    bytes (vLLM's 32-byte hashes, or kvtier's 16-byte ones from :mod:`kvtier.hashing`).
    """

    block_hash: bytes
    group_id: int = 0

    def __repr__(self) -> str:
        return f"BlockKey({self.block_hash.hex()[:16]}…, group={self.group_id})"


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: the layers sharing an attention type and a GPU block size.

    ``layout`` describes one *offloaded* block of this group (its ``block_size`` is
    ``gpu_block_size × block_size_factor`` tokens).
    """

    group_id: int
    gpu_block_size: int
    layout: BlockLayout
    name: str = "full_attention"

    @property
    def offloaded_block_size(self) -> int:
        return self.layout.block_size


def resolve_block_size_factor(gpu_block_sizes: Sequence[int], hash_block_size: int,
                              block_size: int | None, path: str = "block_size") -> int:
    """Return how many GPU blocks form one offloaded block, validating vLLM's rules.

    Every group's GPU block size must be a positive multiple of ``hash_block_size``. Without a
    configured ``block_size`` the factor is 1. With one, all groups must share one GPU block size and
    ``block_size`` must be a multiple of it.
    """
    if hash_block_size <= 0:
        raise KVTierConfigError("hash_block_size",
                                f"must be a positive number of tokens, got {hash_block_size}")
    for i, size in enumerate(gpu_block_sizes):
        if size <= 0 or size % hash_block_size:
            raise KVTierConfigError(
                f"groups[{i}].block_size",
                f"{size} tokens is not a positive multiple of hash_block_size={hash_block_size}")
    if block_size is None:
        return 1
    if block_size <= 0:
        raise KVTierConfigError(path, f"must be a positive number of tokens, got {block_size}")
    if not gpu_block_sizes:
        return 1
    distinct = sorted(set(gpu_block_sizes))
    if len(distinct) > 1:
        raise KVTierConfigError(
            path, f"is set to {block_size}, but the KV-cache groups have different GPU block sizes "
                  f"{distinct}; a configured block_size needs every group to share one block size "
                  f"(remove block_size to offload each group at its own block size)")
    if block_size % distinct[0]:
        raise KVTierConfigError(
            path, f"{block_size} tokens is not a multiple of the GPU block size {distinct[0]}")
    return block_size // distinct[0]


@dataclass(frozen=True)
class KVCacheSpec:
    """The block geometry of one model: hash block size, groups and the offload factor."""

    hash_block_size: int
    groups: tuple[KVGroup, ...]
    block_size_factor: int = 1

    def __post_init__(self) -> None:
        ids = [g.group_id for g in self.groups]
        if len(set(ids)) != len(ids):
            raise KVTierConfigError("groups", f"group ids must be unique, got {ids}")
        for i, g in enumerate(self.groups):
            expected = g.gpu_block_size * self.block_size_factor
            if g.layout.block_size != expected:
                raise KVTierConfigError(
                    f"groups[{i}]", f"layout covers {g.layout.block_size} tokens but the offloaded block is "
                                    f"{g.gpu_block_size} × {self.block_size_factor} = {expected} tokens")
            if g.gpu_block_size % self.hash_block_size:
                raise KVTierConfigError(
                    f"groups[{i}].block_size",
                    f"{g.gpu_block_size} is not a multiple of hash_block_size={self.hash_block_size}")

    def group(self, group_id: int) -> KVGroup:
        for g in self.groups:
            if g.group_id == group_id:
                return g
        raise KeyError(f"no KV-cache group {group_id}; groups are {[g.group_id for g in self.groups]}")

    def hashes_per_block(self, group: KVGroup) -> int:
        """Hash blocks covered by one offloaded block of ``group``."""
        return group.offloaded_block_size // self.hash_block_size

    def block_keys(self, block_hashes: Sequence[bytes]) -> dict[int, list[BlockKey]]:
        """Keys of each group's *full* offloaded blocks for a request's hash-block hashes.

        Offloaded block *j* of a group covering *k* hash blocks is keyed by hash ``(j + 1)·k − 1``;
        a trailing partial block has no key. A model without groups yields ``{}`` (and says so once).
        """
        if not self.groups:
            _warn_no_groups()
            return {}
        out: dict[int, list[BlockKey]] = {}
        for g in self.groups:
            k = self.hashes_per_block(g)
            gid = g.group_id
            out[gid] = [BlockKey(h, gid) for h in block_hashes[k - 1::k]]
        return out

    def tokens_covered(self, group: KVGroup, num_blocks: int) -> int:
        return num_blocks * group.offloaded_block_size


_GROUP_ID = attrgetter("group_id")


def all_of_group(keys: Sequence[BlockKey], group_id: int) -> bool:
    """Whether every one of ``keys`` is of group ``group_id``, in one C-level pass (a batch's check)."""
    return list(map(_GROUP_ID, keys)).count(group_id) == len(keys)


def positions_by_group(keys: Sequence[BlockKey]) -> dict[int, list[int]]:
    """Group id → the positions in ``keys`` of that group's keys, in order (a batch split per slab)."""
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key.group_id, []).append(i)
    return groups
