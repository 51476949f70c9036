"""What prefix reuse saves in transformers' ``generate()``: a long shared prefix, several short suffixes.

A randomly initialised Llama (no download) answers ``--requests`` prompts that share a
``--prefix``-token prefix and differ in a ``--suffix``-token tail, greedy, ``--new-tokens`` each, on
the CPU. Two request sets, A and B, share the prefix and have different suffixes. Measured in the
same run:

* without kvtier: plain ``model.generate()`` on A and on B (the baselines),
* kvtier cpu+file, cold, on A: :class:`~kvtier.connectors.hf.HFPrefixCache` over a CPU tier and a
  file tier (write-through) in a temporary directory; the first request computes and stores the prefix,
* kvtier cpu+file, restarted, on B: a new cache over the same directory (empty CPU tier, the file
  tier's index rebuilt from disk), i.e. what a restarted process gets for new requests,
* with ``--redis URL``: a CPU tier over Redis, cold on A, then a second "server" (a new cache with an
  empty CPU tier) sharing that Redis, on B.

Request *i* runs through every configuration of its set before request *i+1* (so load from other
processes on a shared machine hits all of them alike). Each row gives the total time and its
speed-up over the baseline of the same requests; the time to the first generated token (the
prefill, which is what a prefix cache shortens: decoding costs the same with or without it) of the
first request and of the others; the prompt tokens the model computed; and the tokens loaded with
the tier each loaded block came from. Every request's generated tokens are checked against the
baseline's. Run: ``python benchmarks/bench_hf.py [--prefix 2000] [--suffix 50] [--requests 10]
[--new-tokens 8] [--layers 8] [--hidden 512] [--threads T] [--redis redis://127.0.0.1:6379/0]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvtier.connectors.hf import HFPrefixCache


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=2000, help="shared prefix tokens (default 2000)")
    parser.add_argument("--suffix", type=int, default=50,
                        help="tokens of each request's own tail (default 50)")
    parser.add_argument("--requests", type=int, default=10, help="requests (default 10)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512; head_dim 64)")
    parser.add_argument("--kv-heads", type=int, default=4,
                        help="KV heads (default 4, grouped-query attention)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--block", type=int, default=16, help="tokens per kvtier block (default 16)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--redis", default=None, help="also measure a CPU tier over this Redis (redis://host:port/db)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = args.hidden // 64
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=int(args.hidden * 2.6875), num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.prefix + args.suffix + args.new_tokens + 64,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config).eval().to(getattr(torch, args.dtype))


def build_prompts(args: argparse.Namespace) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Request sets A and B: one shared prefix, a different random suffix per request."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    prefix = torch.randint(0, args.vocab, (args.prefix,), generator=gen)
    sets = [[torch.cat([prefix, torch.randint(0, args.vocab, (args.suffix,), generator=gen)]).unsqueeze(0)
             for _ in range(args.requests)] for _ in range(2)]
    return sets[0], sets[1]


@dataclass
class Row:
    label: str
    requests: str
    seconds: list[float] = field(default_factory=list)
    first_token_seconds: list[float] = field(default_factory=list)
    computed_tokens: int = 0
    reused_tokens: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    outputs: list[torch.Tensor] = field(default_factory=list)


class Runner:
    """One configuration: plain ``generate()`` (``config=None``) or generate through a fresh kvtier cache."""

    def __init__(self, label: str, requests: str, model: Any, new_tokens: int,
                 config: dict[str, Any] | None = None, name: str = "") -> None:
        self.row = Row(label, requests)
        self.model, self.new_tokens = model, new_tokens
        self.reuse = HFPrefixCache.from_config(model, config, model_name=name) if config is not None else None

    def __call__(self, ids: torch.Tensor) -> None:
        from transformers import StoppingCriteria, StoppingCriteriaList

        first_token: list[float] = []

        class FirstTokenClock(StoppingCriteria):
            """Called after every generated token; notes when the first one exists (never stops)."""

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                if not first_token:
                    first_token.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        kwargs = dict(max_new_tokens=self.new_tokens, do_sample=False,
                      stopping_criteria=StoppingCriteriaList([FirstTokenClock()]))
        start = time.perf_counter()
        with torch.no_grad():
            if self.reuse is None:
                out = self.model.generate(ids, **kwargs)
            else:
                out = self.reuse.generate(ids, **kwargs)
        self.row.first_token_seconds.append(first_token[0] - start)
        self.row.seconds.append(time.perf_counter() - start)
        self.row.outputs.append(out)
        if self.reuse is None:
            self.row.computed_tokens += ids.shape[1]
            return
        assert self.reuse.last is not None
        self.row.computed_tokens += self.reuse.last.computed_prompt_tokens
        self.row.reused_tokens += self.reuse.last.reused_tokens
        self.row.hits.update(self.reuse.last.hits_by_tier)

    def close(self) -> Row:
        if self.reuse is not None:
            self.reuse.close()
        return self.row


def interleaved(runners: list[Runner], prompts: list[torch.Tensor]) -> list[Row]:
    """Request i through every configuration before request i+1: a load spike on a shared machine
    hits all configurations alike."""
    for ids in prompts:
        for runner in runners:
            runner(ids)
    return [runner.close() for runner in runners]


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=190)
    model = build_model(args)
    set_a, set_b = build_prompts(args)
    name = f"bench-llama-{uuid.uuid4().hex[:8]}"  # a fresh namespace: no blocks from an earlier run
    with torch.no_grad():  # warm-up: first-call allocations and lazy imports count for no one
        model.generate(set_a[0][:, :64], max_new_tokens=2, do_sample=False)
    n = args.new_tokens
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-hf-") as directory:
        file_config = {"hash_block_size": args.block, "placement": {"write_mode": "write_through"},
                       "tiers": [{"type": "cpu", "capacity": "2GiB"},
                                 {"type": "file", "path": directory, "capacity": "8GiB"}]}
        redis_config = {"hash_block_size": args.block, "placement": {"write_mode": "write_through"},
                        "tiers": [{"type": "cpu", "capacity": "2GiB"},
                                  {"type": "redis", "url": args.redis, "ttl_seconds": 600}]}
        first = [Runner("without kvtier", "A", model, n),
                 Runner("kvtier cpu+file, cold", "A", model, n, file_config, name)]
        if args.redis:
            first.append(Runner("kvtier cpu+redis, cold", "A", model, n, redis_config, name))
        rows = interleaved(first, set_a)
        # The caches above are closed: new ones over the same file directory / Redis, with empty CPU tiers.
        second = [Runner("without kvtier", "B", model, n),
                  Runner("kvtier cpu+file, restarted", "B", model, n, file_config, name)]
        if args.redis:
            second.append(Runner("kvtier cpu+redis, 2nd server", "B", model, n, redis_config, name))
        rows += interleaved(second, set_b)
    baselines = {row.requests: row for row in rows if row.label == "without kvtier"}

    table = Table(title=f"generate(): {args.requests} requests per set = {args.prefix}-token shared prefix + "
                        f"{args.suffix}-token suffix, {args.new_tokens} new tokens each")
    for column in ("configuration", "set", "total s", "speed-up", "1st token s: req 1", "reqs 2+ (mean)",
                   "speed-up 1st token", "prompt tokens computed", "tokens loaded", "blocks loaded from",
                   "same tokens"):
        left = column in ("configuration", "blocks loaded from")
        table.add_column(column, justify="left" if left else "right")
    for row in rows:
        baseline = baselines[row.requests]
        rest = row.first_token_seconds[1:] or row.first_token_seconds
        base_rest = baseline.first_token_seconds[1:]
        same = all(torch.equal(a, b) for a, b in zip(row.outputs, baseline.outputs, strict=True))
        hits = ", ".join(f"{tier} {count}" for tier, count in row.hits.items()) or "-"
        table.add_row(row.label, row.requests, f"{sum(row.seconds):.2f}",
                      f"{sum(baseline.seconds) / sum(row.seconds):.2f}×", f"{row.first_token_seconds[0]:.2f}",
                      f"{sum(rest) / len(rest):.3f}", f"{sum(base_rest or rest) / sum(rest):.2f}×",
                      f"{row.computed_tokens:,}", f"{row.reused_tokens:,}", hits, "yes" if same else "NO")
    console.print(table)
    params = sum(p.numel() for p in model.parameters())
    console.print(f"model: random Llama, {args.layers} layers, hidden {args.hidden}, {args.kv_heads} KV "
                  f"heads, {params / 1e6:.0f} M parameters, {args.dtype}; blocks of {args.block} tokens; "
                  f"torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s)")
    console.print("command: python benchmarks/bench_hf.py " + " ".join(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
