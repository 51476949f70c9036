"""Prefix reuse for transformers' ``generate()`` on a tiny random Llama built here (no downloads).

Exactness: with reuse, the prompt suffix runs as a smaller matmul than in a full prefill. On this
machine's BLAS (MKL) fp32 results agree bit for bit with the full prefill for the 36-token suffixes
used below, while a 1–5 token suffix takes a small-matrix kernel whose last bits differ (≤ 2e-7): the
tests that compute only a few tokens, or reuse K/V of generated tokens, compare greedy tokens exactly
and logits to 1e-5. Without transformers installed the tests skip, unless ``CI`` is set: then they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.errors import KVTierConfigError, LayoutMismatch

try:
    import transformers
except ImportError:
    _missing = "transformers is not installed (pip install 'transformers==5.24.0')"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {_missing}", pytrace=False)
    pytest.skip(_missing, allow_module_level=True)

from kvtier.connectors.hf import HFPrefixCache, model_section  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16
SHARED = 64  # four blocks shared by the prompts below
GENERATE = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval().to(dtype)


def prompt(suffix_seed: int, shared: int = SHARED, suffix: int = 36) -> torch.Tensor:
    head = torch.randint(0, 512, (shared,), generator=torch.Generator().manual_seed(1234))
    tail = torch.randint(0, 512, (suffix,), generator=torch.Generator().manual_seed(suffix_seed))
    return torch.cat([head, tail]).unsqueeze(0)


def tiers(root: Path) -> dict[str, Any]:
    return {"hash_block_size": BLOCK, "tiers": [{"type": "cpu", "capacity": "8MiB"},
                                                 {"type": "file", "path": str(root), "capacity": "32MiB"}]}


class TokenCounter:
    """Tokens each forward pass of the model ran over (a pre-hook on the embedding)."""

    def __init__(self, model: Any) -> None:
        self.passes: list[int] = []
        self._handle = model.get_input_embeddings().register_forward_pre_hook(
            lambda _module, args: self.passes.append(int(args[0].shape[-1])))

    def take(self) -> list[int]:
        passes, self.passes = self.passes, []
        return passes


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


@pytest.fixture
def reuse(model: Any, tmp_path: Path) -> Iterator[HFPrefixCache]:
    with HFPrefixCache.from_config(model, tiers(tmp_path / "kv"), model_name="tiny-llama-seed0") as cache:
        yield cache


def same_logits(a: Any, b: Any) -> bool:
    return len(a.logits) == len(b.logits) \
        and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))


def test_greedy_outputs_and_logits_equal_those_without_reuse(model: Any, reuse: HFPrefixCache) -> None:
    first, second = prompt(1), prompt(2)
    assert same_logits(reuse.generate(first, **GENERATE), model.generate(first, **GENERATE))
    assert reuse.last is not None and reuse.last.reused_tokens == 0
    with_reuse = reuse.generate(second, **GENERATE)
    baseline = model.generate(second, **GENERATE)
    assert reuse.last.reused_tokens == SHARED
    assert torch.equal(with_reuse.sequences, baseline.sequences)
    assert same_logits(with_reuse, baseline)  # exactly, in fp32


def test_second_call_computes_only_the_uncached_suffix(model: Any, reuse: HFPrefixCache) -> None:
    counter = TokenCounter(model)
    reuse.generate(prompt(1), **GENERATE)
    assert counter.take() == [100] + [1] * 5  # prefill, then one token per step
    reuse.generate(prompt(2), **GENERATE)
    assert counter.take() == [100 - SHARED] + [1] * 5
    report = reuse.last
    assert report is not None
    assert (report.prompt_tokens, report.reused_tokens, report.computed_prompt_tokens) == (100, SHARED, 36)
    assert report.hits_by_tier == {"cpu": SHARED // BLOCK}
    # stored: the blocks of prompt 2 and its first generated tokens not cached yet, (100 + 5) // 16 - 4
    assert report.stored_blocks == 2
    # every block is stored with the one before it as its predecessor: eviction keeps chains whole
    chain = reuse.block_keys(prompt(2)[0].tolist())  # six full blocks, all stored by now
    for j in range(1, len(chain)):
        links = {index.hint(chain[j]).predecessor for index in reuse.cache.core.residency.tiers
                 if chain[j] in index}
        assert links == {chain[j - 1]}, j


def test_same_prompt_again_computes_only_its_last_tokens(model: Any, reuse: HFPrefixCache) -> None:
    counter = TokenCounter(model)
    ids = prompt(3)  # 100 tokens: 6 full blocks, and the last token is always computed
    reuse.generate(ids, **GENERATE)
    counter.take()
    again = reuse.generate(ids, **GENERATE)
    assert counter.take()[0] == 100 - 96
    baseline = model.generate(ids, **GENERATE)
    assert torch.equal(again.sequences, baseline.sequences)
    for x, y in zip(again.logits, baseline.logits, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)  # a 4-token suffix: see the module docstring


def test_a_block_aligned_prompt_leaves_its_last_block_to_compute(model: Any, reuse: HFPrefixCache) -> None:
    counter = TokenCounter(model)
    ids = prompt(4, suffix=0)  # exactly the 64 shared tokens
    reuse.generate(ids, **GENERATE)
    counter.take()
    reuse.generate(ids, **GENERATE)
    assert counter.take()[0] == BLOCK  # 3 blocks loaded: at least one token must give the first logits
    assert reuse.last is not None and reuse.last.reused_tokens == SHARED - BLOCK


def test_generated_tokens_are_reused_by_the_next_turn(model: Any, reuse: HFPrefixCache) -> None:
    turn1 = reuse.generate(prompt(5), max_new_tokens=30, do_sample=False, return_dict_in_generate=True)
    history = turn1.sequences  # 130 tokens; K/V of 129 of them were computed
    turn2 = torch.cat([history, prompt(6, shared=0, suffix=20)], dim=1)
    counter = TokenCounter(model)
    out = reuse.generate(turn2, max_new_tokens=4, do_sample=False)
    assert reuse.last is not None and reuse.last.reused_tokens == 128  # into the generated tokens
    assert counter.take()[0] == turn2.shape[1] - 128
    assert torch.equal(out, model.generate(turn2, max_new_tokens=4, do_sample=False))


def test_two_models_sharing_a_tier_never_read_each_other(tmp_path: Path) -> None:
    config = tiers(tmp_path / "shared")
    first, other = tiny_llama(seed=0), tiny_llama(seed=1)
    with HFPrefixCache.from_config(first, config, model_name="llama-a") as a:
        a.generate(prompt(1), max_new_tokens=1)
    with HFPrefixCache.from_config(other, config, model_name="llama-b") as b:
        b.generate(prompt(2), max_new_tokens=1)
        assert b.last is not None and b.last.reused_tokens == 0


def test_reuse_across_two_processes_through_the_file_tier(model: Any, tmp_path: Path) -> None:
    config = {"hash_block_size": BLOCK,
              "tiers": [{"type": "file", "path": str(tmp_path / "kv"), "capacity": "32MiB"}]}
    writer = subprocess.run([sys.executable, "-c", "import json, sys; from tests.connectors.test_hf import "
                             "_generate_in_child as run; print(json.dumps(run(json.loads(sys.argv[1]), 1)))",
                             json.dumps(config)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert writer.returncode == 0, writer.stderr
    assert json.loads(writer.stdout.splitlines()[-1]) == {"reused_tokens": 0, "hits_by_tier": {}}
    with HFPrefixCache.from_config(model, config, model_name="tiny-llama-seed0") as reuse:
        with_reuse = reuse.generate(prompt(2), **GENERATE)
        assert reuse.last is not None
        assert (reuse.last.reused_tokens, dict(reuse.last.hits_by_tier)) \
            == (SHARED, {"file": SHARED // BLOCK})
    assert same_logits(with_reuse, model.generate(prompt(2), **GENERATE))


def _generate_in_child(config: dict[str, Any], suffix_seed: int) -> dict[str, Any]:
    """The writer process of the test above: same model (same seed), one prompt, then exit."""
    with HFPrefixCache.from_config(tiny_llama(), config, model_name="tiny-llama-seed0") as reuse:
        reuse.generate(prompt(suffix_seed), **GENERATE)
        assert reuse.last is not None
        return {"reused_tokens": reuse.last.reused_tokens, "hits_by_tier": dict(reuse.last.hits_by_tier)}


def test_a_dead_tier_is_a_miss_not_an_error(model: Any) -> None:
    with socket_port() as port:
        config = {"tiers": [{"type": "redis", "url": f"redis://127.0.0.1:{port}/0", "connect_timeout": 0.2,
                             "timeout": 0.2}]}
    with HFPrefixCache.from_config(model, config, model_name="tiny-llama-seed0") as reuse:
        for seed in (1, 2):
            out = reuse.generate(prompt(seed), **GENERATE)
            assert reuse.last is not None and (reuse.last.reused_tokens, reuse.last.stored_blocks) == (0, 0)
            assert same_logits(out, model.generate(prompt(seed), **GENERATE))


def test_bf16_model_round_trips_its_blocks(tmp_path: Path) -> None:
    model16 = tiny_llama(dtype=torch.bfloat16)
    with HFPrefixCache.from_config(model16, tiers(tmp_path / "kv"), model_name="tiny-bf16") as reuse:
        reuse.generate(prompt(1), max_new_tokens=1)
        kv_cache, cached = reuse.load_prefix(prompt(2)[0].tolist())
    assert cached == SHARED
    with torch.no_grad():  # the prefill generate() ran: the same 100 tokens in one pass
        fresh = model16(prompt(1), use_cache=True)
    fresh_cache = getattr(fresh, "cache", None) or fresh.past_key_values
    for loaded, computed in zip(kv_cache.layers, fresh_cache.layers, strict=True):
        assert loaded.keys.dtype == torch.bfloat16
        assert torch.equal(loaded.keys, computed.keys[:, :, :SHARED])
        assert torch.equal(loaded.values, computed.values[:, :, :SHARED])


@pytest.mark.parametrize("token_layout", ["HND", "NHD"])
def test_stored_blocks_hold_each_layers_kv_in_the_layouts_order(model: Any, tmp_path: Path,
                                                                token_layout: str) -> None:
    """A block's bytes are ``layout.logical_view``'s ``[layer, K|V, token, head, dim]`` of the cache's K/V,
    whichever token order the config asks for, and load back into the same tensors."""
    config = {**tiers(tmp_path / "kv"),
              "model": {**model_section(model, "tiny"), "token_layout": token_layout}}
    tokens = prompt(3)[0].tolist()
    with torch.no_grad():
        computed = model(prompt(3), use_cache=True)
    kv = getattr(computed, "cache", None) or computed.past_key_values
    with HFPrefixCache.from_config(model, config) as reuse:
        assert reuse.store_prefix(tokens, kv, start_block=1) == len(tokens) // BLOCK - 1
        keys = reuse.block_keys(tokens)
        blocks = torch.empty((len(keys), *reuse.layout.shape), dtype=reuse.layout.dtype)
        assert reuse.cache.load(keys[1:], blocks[1:]) == len(keys) - 1
        logical = reuse.layout.logical_view(blocks)  # [block, layer, kv, token, head, dim]
        for layer, cached in enumerate(kv.layers):
            for i, tensor in enumerate((cached.keys, cached.values)):
                for b in range(1, len(keys)):
                    want = tensor[0, :, b * BLOCK:(b + 1) * BLOCK].transpose(0, 1)  # [token, head, dim]
                    assert torch.equal(logical[b, layer, i], want)
        reuse.store_prefix(tokens, kv)
        loaded, count = reuse.load_prefix(tokens + [0])
    assert count == len(keys) * BLOCK
    for layer, cached in zip(loaded.layers, kv.layers, strict=True):
        assert torch.equal(layer.keys, cached.keys[:, :, :count])
        assert torch.equal(layer.values, cached.values[:, :, :count])


# --- misuse -------------------------------------------------------------------------------------------
def test_a_model_built_in_code_needs_a_name(model: Any, tmp_path: Path) -> None:
    with pytest.raises(KVTierConfigError, match="model_name"):
        HFPrefixCache.from_config(model, tiers(tmp_path))
    assert model_section(model, "x")["token_layout"] == "HND"


def test_a_cache_of_another_geometry_is_refused(model: Any, tmp_path: Path) -> None:
    config = {**tiers(tmp_path), "model": {**model_section(model, "x"), "num_kv_heads": 4}}
    with pytest.raises(LayoutMismatch, match="num_kv_heads=4 but the model has 2"):
        HFPrefixCache.from_config(model, config)


def test_sliding_window_models_are_refused(tmp_path: Path) -> None:
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        sliding_window=32)
    mistral = transformers.MistralForCausalLM(config)
    with pytest.raises(LayoutMismatch, match="full attention"):
        HFPrefixCache.from_config(mistral, tiers(tmp_path), model_name="tiny-mistral")


def test_one_unpadded_prompt_per_call(reuse: HFPrefixCache) -> None:
    with pytest.raises(ValueError, match="one prompt"):
        reuse.generate(torch.zeros((2, 20), dtype=torch.long))
    with pytest.raises(ValueError, match="all ones"):
        reuse.generate(prompt(1), attention_mask=torch.zeros((1, 100), dtype=torch.long))


class socket_port:
    """A loopback port with nothing listening (bound, then released)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        return None
