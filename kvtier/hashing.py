"""Namespaces and stable chained token-block hashes for embedded users.

Engines bring their own block hashes; an application embedding kvtier directly uses
:func:`hash_token_blocks`. Either way every stored key lives under a :class:`Namespace` — a
fingerprint of model, dtype, layout and tensor-parallel rank — so two models, or one model under two
layouts, sharing a file directory or a Redis never read each other's blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

#: Bytes of a kvtier-made block hash (xxh3-128).
HASH_BYTES = 16


def namespace_fingerprint(namespace: str) -> int:
    """The 64-bit fingerprint a tier writes into every block header it stores under ``namespace`` (an id)."""
    return xxhash.xxh3_64_intdigest(b"kvtier-namespace:" + namespace.encode())


@dataclass(frozen=True)
class Namespace:
    """Who a block belongs to. Its :attr:`id` prefixes every key a tier stores."""

    model: str
    dtype: str
    layout_fingerprint: int
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def id(self) -> str:
        """16 hex digits, stable across processes and machines."""
        text = f"{self.model}|{self.dtype}|{self.layout_fingerprint:016x}|{self.tp_rank}/{self.tp_size}"
        return xxhash.xxh3_64_hexdigest(text.encode())

    @property
    def fingerprint(self) -> int:
        """64 bits every stored block's header carries (:mod:`kvtier.codec`); checked on every read."""
        return namespace_fingerprint(self.id)

    @property
    def salt(self) -> bytes:
        """Root of every hash chain in this namespace."""
        return xxhash.xxh3_128_digest(b"kvtier-ns:" + self.id.encode())


def hash_token_blocks(token_ids: Sequence[int] | np.ndarray, hash_block_size: int, namespace: Namespace,
                      extra_keys: Iterable[bytes | str | int] | None = None) -> list[bytes]:
    """Chained hashes of the *full* ``hash_block_size``-token blocks of ``token_ids``.

    Hash *i* = xxh3-128(hash *i-1* ‖ tokens of block *i* as little-endian int64 ‖ extra keys), with
    hash −1 = the namespace salt: equal hash ⇔ equal namespace, extra keys (LoRA id, image hashes)
    and whole prefix. A trailing partial block is not hashed.
    """
    if hash_block_size <= 0:
        raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {tokens.dtype}")
    n_full = tokens.size // hash_block_size
    blocks = tokens[: n_full * hash_block_size].astype("<i8", copy=False).reshape(n_full, hash_block_size)
    extra = b"".join(_key_bytes(k) for k in extra_keys) if extra_keys is not None else b""
    hashes: list[bytes] = []
    prev = namespace.salt
    hasher = xxhash.xxh3_128()
    for row in blocks:
        hasher.reset()
        hasher.update(prev)
        hasher.update(row.tobytes())
        if extra:
            hasher.update(extra)
        prev = hasher.digest()
        hashes.append(prev)
    return hashes


def _key_bytes(key: bytes | str | int) -> bytes:
    if isinstance(key, bytes):
        return len(key).to_bytes(4, "little") + key
    if isinstance(key, str):
        return _key_bytes(key.encode())
    if isinstance(key, int):
        return _key_bytes(key.to_bytes(16, "little", signed=True))
    raise TypeError(f"extra key must be bytes, str or int, got {type(key).__name__}")
