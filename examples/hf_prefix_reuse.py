"""Prefix reuse across ``generate()`` calls of a Hugging Face model, through kvtier.

Two prompts share a long prefix (a system prompt); the second call loads the prefix's K/V from
kvtier and computes only its own tail. Run it twice: the second run is a new process and finds the
prefix in the file tier. Without ``--model`` it builds a small random Llama (nothing is downloaded);
with ``--model NAME`` it loads that model with ``from_pretrained`` and uses its tokenizer.

    python examples/hf_prefix_reuse.py [--model NAME] [--dir /tmp/kvtier-hf-example]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from kvtier.connectors.hf import HFPrefixCache

SYSTEM = "You are a careful assistant. Answer in one short paragraph. " * 40


def load(name: str | None) -> tuple[Any, Any]:
    import transformers

    if name:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval(), tokenizer
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), None


def encode(tokenizer: Any, text: str) -> torch.Tensor:
    if tokenizer is not None:
        return tokenizer(text, return_tensors="pt").input_ids
    data = text.encode()  # the random model: one token per byte
    return torch.tensor([list(data)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="a Hugging Face model id (default: a random tiny Llama)")
    parser.add_argument("--dir", default="/tmp/kvtier-hf-example", help="the file tier's directory")
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    config = {
        "hash_block_size": 16,                                  # tokens per block
        "placement": {"write_mode": "write_through"},           # every block also goes to the file tier
        "tiers": [{"type": "cpu", "capacity": "1GiB"},
                  {"type": "file", "path": args.dir, "capacity": "10GiB"}],
    }
    # The model section (layers, KV heads, head_dim, dtype) is read from the model; a model built in
    # code has no name_or_path, so it gets a name here: the name keeps models sharing a tier apart.
    with HFPrefixCache.from_config(model, config, model_name=args.model or "random-llama-seed0") as reuse:
        for question in ("What is a KV cache?", "Why does prefix caching help?"):
            ids = encode(tokenizer, SYSTEM + question)
            start = time.perf_counter()
            out = reuse.generate(ids, max_new_tokens=20, do_sample=False)
            seconds = time.perf_counter() - start
            report = reuse.last
            assert report is not None
            print(f"{question!r}: {report.prompt_tokens} prompt tokens, {report.reused_tokens} loaded "
                  f"({dict(report.hits_by_tier) or 'no hits'}), {report.computed_prompt_tokens} computed, "
                  f"{report.stored_blocks} blocks stored, {seconds:.2f} s")
            if tokenizer is not None:
                print("  →", tokenizer.decode(out[0, ids.shape[1]:]))
        for tier in reuse.cache.stats().tiers:
            print(f"tier {tier.name}: {tier.hits} hits, {tier.stores} stores, "
                  f"{tier.usage_bytes / 2**20:.1f} MiB held")


if __name__ == "__main__":
    main()
