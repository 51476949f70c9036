"""Prefix reuse for Hugging Face transformers' ``generate()``, over a :class:`~kvtier.TieredCache`.

:meth:`HFPrefixCache.generate` loads the longest cached run of a prompt's full token blocks into a
fresh ``DynamicCache``, lets ``generate()`` compute the rest, then stores the new full blocks, so the
next prompt sharing the prefix (in this process or another sharing a file or Redis tier) starts
further on. One prompt per call; models whose cache drops or transforms old tokens are refused.
transformers (≥ 4.56) is imported lazily. Layout, exactness and limits: docs/hf.md.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.blocks import BlockKey, KVGroup
from kvtier.cache import TieredCache
from kvtier.config import read_config_mapping
from kvtier.errors import KVTierConfigError, LayoutMismatch
from kvtier.hashing import hash_token_blocks
from kvtier.layout import BlockLayout, dtype_name
from kvtier.pages import PageMover

log = logging.getLogger(__name__)

#: Tokens per block when the config does not say.
DEFAULT_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class ReuseReport:
    """What one :meth:`HFPrefixCache.generate` call reused, computed and stored."""

    prompt_tokens: int
    #: Leading prompt tokens whose K/V came from kvtier instead of being computed.
    reused_tokens: int
    #: Blocks loaded from each tier (by tier name); empty on a miss.
    hits_by_tier: Mapping[str, int]
    #: Full blocks stored after generating (prompt and generated tokens not cached before).
    stored_blocks: int

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens the model ran a forward pass over."""
        return self.prompt_tokens - self.reused_tokens


def model_section(model: Any, model_name: str | None = None) -> dict[str, Any]:
    """The ``model:`` section of a kvtier config describing ``model``'s KV cache (``HND`` layout).

    ``model_name`` defaults to the model's ``name_or_path``; a model without one (built in code)
    needs it, since the name is what keeps two models sharing a tier apart.
    """
    name = model_name or getattr(model.config, "name_or_path", "") or ""
    if not name:
        raise KVTierConfigError("model.name", "the model has no name_or_path (it was built in code); pass "
                                "model_name=… — it keys the cache, so two different models must not share it")
    return {"name": name, **_kv_geometry(model), "token_layout": "HND"}


def _kv_geometry(model: Any) -> dict[str, Any]:
    """Layers, KV heads, head_dim and dtype of ``model``'s KV cache, in kvtier's config spelling."""
    config = _text_config(model.config)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"num_layers": int(config.num_hidden_layers), "num_kv_heads": int(heads),
            "head_dim": int(head_dim), "dtype": dtype_name(_model_dtype(model))}


class HFPrefixCache:
    """Prefix reuse around ``model.generate()`` for one causal LM and one :class:`TieredCache`.

    Build with :meth:`from_config` (fills the config's ``model:`` section from the model), or pass a
    cache whose first group matches the model (checked: layers, KV heads, head_dim, dtype, K/V).
    Use one instance from one thread at a time. ``owns_cache`` makes :meth:`close` close the cache.
    """

    def __init__(self, model: Any, cache: TieredCache, *, owns_cache: bool = False) -> None:
        self.model = model
        self.cache = cache
        self.owns_cache = owns_cache
        if not cache.spec.groups:
            raise LayoutMismatch("the cache has no KV-cache groups; a causal LM needs one full-attention "
                                 "group")
        self.group: KVGroup = cache.spec.groups[0]
        self.layout: BlockLayout = self.group.layout
        self._check_layout()
        self._cache_arg = _cache_argument_name(model)
        self._check_full_attention()
        self.last: ReuseReport | None = None

    @classmethod
    def from_config(cls, model: Any, config: str | Path | Mapping[str, Any], *,
                    model_name: str | None = None) -> HFPrefixCache:
        """Build the cache from a YAML path or dict; its ``model:`` section is filled from ``model``.

        A config that has a ``model:`` section keeps it (and it must match the model); one without
        gets :func:`model_section`, and ``hash_block_size`` defaults to 16 tokens.
        """
        data = read_config_mapping(config)
        if "model" not in data:
            data["model"] = model_section(model, model_name)
        elif model_name is not None:
            data["model"] = {**data["model"], "name": model_name}
        data.setdefault("hash_block_size", DEFAULT_BLOCK_TOKENS)
        return cls(model, TieredCache.from_config(data), owns_cache=True)

    # --- the one call users make ------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor | Sequence[int], **generate_kwargs: Any) -> Any:
        """``model.generate(input_ids, **generate_kwargs)``, computing only the uncached prompt suffix.

        Takes one prompt (``[1, T]`` or a list of ids) and returns what ``generate`` returns. The
        cached prefix is loaded (never the whole prompt: the last token is always computed, it gives
        the first logits); after generating, new full blocks are stored. A tier fault is a miss or a
        skipped store, never an exception. :attr:`last` describes what happened.
        """
        ids = self._prompt(input_ids)
        if self._cache_arg in generate_kwargs or "past_key_values" in generate_kwargs:
            raise ValueError("HFPrefixCache.generate builds the KV cache itself; do not pass one")
        if generate_kwargs.get("use_cache") is False:
            raise ValueError("use_cache=False leaves no KV cache to reuse or store")
        mask = generate_kwargs.pop("attention_mask", None)
        if mask is not None and not bool(torch.all(mask != 0)):
            raise ValueError("the attention mask must be all ones (one unpadded prompt)")
        tokens = ids[0].tolist()
        keys = self._keys(tokens)
        usable = min(len(keys), (len(tokens) - 1) // self.layout.block_size)
        kv_cache, loaded, hits = self._load_prefix(keys[:usable])
        output = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     **{self._cache_arg: kv_cache}, **generate_kwargs)
        stored = self._store_new_blocks(kv_cache, output, tokens, loaded)
        self.last = ReuseReport(prompt_tokens=len(tokens), reused_tokens=loaded * self.layout.block_size,
                                hits_by_tier=hits, stored_blocks=stored)
        return output

    def close(self) -> None:
        if self.owns_cache:
            self.cache.close()

    def __enter__(self) -> HFPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- building blocks, usable on their own -----------------------------------------------------------
    def block_keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        """Keys of the full offloaded blocks of ``token_ids`` in this model's namespace."""
        return self._keys(list(token_ids))

    def load_prefix(self, token_ids: Sequence[int]) -> tuple[Any, int]:
        """A ``DynamicCache`` holding the longest cached prefix of ``token_ids``, and its token count."""
        kv_cache, loaded, _ = self._load_prefix(self._keys(list(token_ids)))
        return kv_cache, loaded * self.layout.block_size

    def store_prefix(self, token_ids: Sequence[int], kv_cache: Any, start_block: int = 0) -> int:
        """Store the full blocks of ``token_ids`` from ``start_block`` on that ``kv_cache`` (batch row 0)
        holds; return how many are cached now."""
        tokens = list(token_ids)
        full = min(len(tokens), kv_cache.get_seq_length()) // self.layout.block_size
        keys = self._keys(tokens[: full * self.layout.block_size])
        if full <= start_block:
            return 0
        blocks = self._pack(kv_cache, start_block, full)
        predecessors = [keys[j - 1] if j else None for j in range(start_block, full)]  # keys are chained
        return self.cache.store(keys[start_block:full], blocks, predecessors=predecessors)

    # --- internals ----------------------------------------------------------------------------------------
    def _prompt(self, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        device = _model_device(self.model)
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor([list(input_ids)])
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"HFPrefixCache.generate takes one prompt ([1, T] ids), got shape "
                             f"{tuple(ids.shape)}; call it once per prompt")
        if ids.shape[1] == 0:
            raise ValueError("the prompt is empty")
        return ids.to(device=device, dtype=torch.long)

    def _keys(self, tokens: list[int]) -> list[BlockKey]:
        namespace = self.cache.core.namespace
        if namespace is None:
            raise LayoutMismatch("the cache has no namespace (build it with TieredCache.from_config)")
        hashes = hash_token_blocks(tokens, self.cache.spec.hash_block_size, namespace)
        return self.cache.spec.block_keys(hashes)[self.group.group_id]

    def _load_prefix(self, keys: list[BlockKey]) -> tuple[Any, int, dict[str, int]]:
        kv_cache = self._new_dynamic_cache()
        found = self.cache.lookup(keys) if keys else 0
        if not found:
            return kv_cache, 0, {}
        before = [t.hits for t in self.cache.stats().tiers]
        buffer = torch.empty((found, *self.layout.shape), dtype=self.layout.dtype)
        loaded = self.cache.load(keys[:found], buffer)
        after = self.cache.stats().tiers
        hits = {t.name: t.hits - b for t, b in zip(after, before, strict=True) if t.hits > b}
        if loaded:
            self._unpack(buffer[:loaded], kv_cache)
        return kv_cache, loaded, hits

    def _new_dynamic_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56 builds layers lazily
            return DynamicCache()

    def _unpack(self, blocks: torch.Tensor, kv_cache: Any) -> None:
        """``[n, *layout.shape]`` blocks → per-layer ``[1, heads, n·block_size, head_dim]`` K and V."""
        n, bs = blocks.shape[0], self.layout.block_size
        shape = (1, self.layout.num_kv_heads, n * bs, self.layout.head_dim)
        device = _model_device(self.model)
        tensors = [torch.empty(shape, dtype=self.layout.dtype, device=device)
                   for _ in range(2 * self.layout.num_layers)]
        self._mover(tensors, n).scatter(blocks, range(n))
        for layer in range(self.layout.num_layers):
            kv_cache.update(tensors[2 * layer], tensors[2 * layer + 1], layer)

    def _pack(self, kv_cache: Any, start_block: int, end_block: int) -> torch.Tensor:
        """Blocks ``[start_block, end_block)`` of batch row 0 as ``[n, *layout.shape]`` on the CPU."""
        out = torch.empty((end_block - start_block, *self.layout.shape), dtype=self.layout.dtype)
        tensors = [t for layer in _cache_layers(kv_cache) for t in (layer.keys, layer.values)]
        self._mover(tensors, end_block).gather(range(start_block, end_block), out)
        return out

    def _mover(self, tensors: list[torch.Tensor], num_blocks: int) -> PageMover:
        """The first ``num_blocks`` blocks of K and V ``[batch, heads, tokens, head_dim]`` tensors (layer
        order, K before V; batch row 0) as page regions ``[block, heads, token, dim]`` (``HND`` blocks) or
        ``[block, token, heads, dim]`` (``NHD``)."""
        bs = self.layout.block_size
        order = (1, 0, 2, 3) if self.layout.token_layout == "HND" else (1, 2, 0, 3)
        regions = [t[0, :, :num_blocks * bs].unflatten(1, (num_blocks, bs)).permute(order) for t in tensors]
        return PageMover(regions, 1, self.layout.nbytes)

    def _store_new_blocks(self, kv_cache: Any, output: Any, prompt: list[int], loaded: int) -> int:
        sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
        layers = _cache_layers(kv_cache)
        batch = layers[0].keys.shape[0] if layers and layers[0].keys is not None else 0
        if batch == 0:
            return 0
        # Several rows (beams, num_return_sequences): their prompt K/V are equal; their continuations differ.
        tokens = sequences[0].tolist() if batch == 1 and sequences is not None else prompt
        return self.store_prefix(tokens, kv_cache, start_block=loaded)

    def _check_layout(self) -> None:
        expected = _kv_geometry(self.model)
        layout = self.layout
        found = {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                 "head_dim": layout.head_dim, "dtype": dtype_name(layout.dtype)}
        wrong = {k: (v, expected[k]) for k, v in found.items() if v != expected[k]}
        if layout.kv_factor != 2:
            wrong["mla"] = (True, False)
        if wrong:
            detail = ", ".join(f"{k}={have} but the model has {want}" for k, (have, want) in wrong.items())
            raise LayoutMismatch(f"the cache's block layout ({layout.describe()}) does not fit the model: "
                                 f"{detail}")

    def _check_full_attention(self) -> None:
        try:
            from transformers.cache_utils import DynamicLayer
        except ImportError:
            raise LayoutMismatch("this transformers release has no cache layers; kvtier needs "
                                 "transformers >= 4.56") from None
        layers = self._new_dynamic_cache().layers
        others = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
        if others:
            raise LayoutMismatch(f"the model's KV cache has {', '.join(others)} layers (sliding-window, "
                                 f"chunked or hybrid attention); kvtier's prefix reuse needs full attention "
                                 f"in every layer")
        if layers and len(layers) != self.layout.num_layers:
            raise LayoutMismatch(f"the model's cache has {len(layers)} layers, the block layout "
                                 f"{self.layout.num_layers}")


def _cache_layers(kv_cache: Any) -> list[Any]:
    return [layer for layer in kv_cache.layers if getattr(layer, "keys", None) is not None]


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def _model_dtype(model: Any) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def _cache_argument_name(model: Any) -> str:
    """``cache`` (transformers 5) or ``past_key_values`` (4.x): what ``forward`` calls the KV cache."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


__all__ = ["DEFAULT_BLOCK_TOKENS", "HFPrefixCache", "ReuseReport", "model_section"]
