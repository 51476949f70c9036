"""Replay request traces through the cache's own residency and policy objects, metadata only.

``kvtier replay`` answers "what would this policy and placement have done on this workload": one
:class:`~kvtier.residency.TierIndex` per tier and a :class:`~kvtier.residency.Residency`, the objects
:class:`~kvtier.cache.TieredCache` plans with, and per request what the cache does (locate, touch,
promote, store), with plans executed against nothing and counted. Beside every policy it replays
LRU and two ceilings (Belady's MIN under the replay's rules, Belady with bypass). docs/policies.md
describes the rules, the trace formats (Mooncake, generic, Azure and BurstGPT CSV) and the output
columns.

One module: a trace, its replay and the table of results are read together (the table's columns are
the replay's counters, its baselines the runs the replay adds); the command line is
:mod:`kvtier.cli_replay`, the policies are in :mod:`kvtier.policy`.
"""

from __future__ import annotations

import bz2
import csv
import datetime
import gc
import gzip
import hashlib
import heapq
import itertools
import json
import lzma
import math
import re
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeGuard, cast

from kvtier.blocks import BlockKey
from kvtier.errors import KVTierError
from kvtier.policy import DEFAULT_EVICTION, EvictionPolicy, InsertHint
from kvtier.policy.admission import AdmitAll
from kvtier.policy.belady import NEVER, BeladyPolicy
from kvtier.policy.placement import PlacementPolicy
from kvtier.residency import READY, Residency, TierIndex

#: Tokens per hash id in Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512
#: Tokens per block of an Azure CSV trace (it has no blocks of its own; 16 as vLLM's default).
AZURE_BLOCK_TOKENS = 16
TRACE_FORMATS = ("auto", "mooncake", "generic", "azure", "burstgpt")
#: KV bytes per token of Llama-3-8B in bf16 (32 layers × 2 × 8 KV heads × 128 × 2 bytes); the default
#: for turning block counts into bytes.
DEFAULT_BYTES_PER_TOKEN = 131072
MIN_POLICY = "min"
#: Belady with bypass, per block reference: the block-hit ceiling no admit-every-miss cache reaches.
BELADY_POLICY = "belady"
CEILINGS = (MIN_POLICY, BELADY_POLICY)


class TraceFormatError(KVTierError, ValueError):
    """A trace line is malformed; the message starts with ``path:line``."""


@dataclass
class Trace:
    """A request trace with its block keys built once (equal ids share one key object).

    ``timestamps``: each request's arrival in seconds after the first request's, when the file gives
    every request one (empty otherwise). ``prefix_information``: False when the format carries no
    prefix information (Azure CSV: every block id is new, so no block can ever hit).
    """

    name: str
    format: str
    block_tokens: int
    requests: list[list[BlockKey]]
    tokens: list[int]
    distinct_blocks: int
    timestamps: list[float] = field(default_factory=list)
    prefix_information: bool = True

    _hints: list[list[InsertHint]] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def references(self) -> int:
        return sum(len(r) for r in self.requests)

    def chain_hints(self) -> list[list[InsertHint]]:
        """Per request, the insert hint of each block (:func:`chain_hints`), built once per trace.

        Equal hints share one object (a block id recurs with the same position and predecessor), so
        this costs memory per distinct block, not per reference."""
        if self._hints is None:
            shared: dict[tuple[int, BlockKey | None], InsertHint] = {}
            hints = []
            for keys in self.requests:
                row = []
                pred = None
                for j, key in enumerate(keys):
                    hint = shared.get((j, pred))
                    if hint is None:
                        hint = shared[(j, pred)] = InsertHint(j, -1, pred)
                    row.append(hint)
                    pred = key
                hints.append(row)
            self._hints = hints
        return self._hints

    @property
    def input_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def duration_seconds(self) -> float | None:
        """Seconds from the first request's arrival to the last one's (None without timestamps)."""
        return max(self.timestamps) - min(self.timestamps) if self.timestamps else None

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "format": self.format, "requests": len(self.requests),
                "block_references": self.references, "distinct_blocks": self.distinct_blocks,
                "input_tokens": self.input_tokens, "block_tokens": self.block_tokens}


class _KeyMaker:
    """Ids → BlockKeys, one object per distinct id."""

    def __init__(self) -> None:
        self.keys: dict[int | str, BlockKey] = {}

    def __call__(self, block_id: int | str) -> BlockKey:
        key = self.keys.get(block_id)
        if key is None:
            if isinstance(block_id, int):
                raw = block_id.to_bytes(8, "little")
            else:
                raw = hashlib.blake2b(block_id.encode(), digest_size=16).digest()
            key = self.keys[block_id] = BlockKey(raw, 0)
        return key


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def read_trace(path: str | Path, *, format: str = "auto", block_tokens: int | None = None,
               limit: int | None = None) -> Trace:
    """Read a Mooncake or generic JSONL trace, or an Azure or BurstGPT CSV trace, plain or gzip/bz2/xz
    compressed (see docs/policies.md).

    ``format`` is ``auto`` (a CSV header on the first non-empty line, else decided by the first
    request line), ``mooncake``, ``generic``, ``azure`` or ``burstgpt``. ``block_tokens`` defaults to
    what the format says (a Mooncake-format file: read off its lines). ``limit`` keeps the first N
    requests. Raises :class:`TraceFormatError` naming the file (and line).
    """
    if format not in TRACE_FORMATS:
        raise ValueError(f"format must be one of {', '.join(map(repr, TRACE_FORMATS))}, got {format!r}")
    if block_tokens is not None and block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    path = Path(path)
    handle = _open_text(path)
    make_key = _KeyMaker()
    requests: list[list[BlockKey]] = []
    tokens: list[int] = []
    kind = None if format == "auto" else format
    header_block_tokens: int | None = None
    stamps: list[float] | None = []  # None once a request has no usable timestamp
    sizes: list[tuple[str, int, int]] = []  # Mooncake format: (where, hash ids, input_length) per request
    seconds = False  # Mooncake format: timestamps in seconds (Bailian), not milliseconds
    try:
        with handle:
            lines = enumerate(handle, 1)
            first = next(((n, line) for n, line in lines if line.strip()), None)
            if format in _LENGTH_CSV or (format == "auto" and first is not None and _length_csv(first[1])):
                return _read_length_csv(path, first, lines, block_tokens=block_tokens, limit=limit)
            for lineno, line in itertools.chain([first] if first is not None else [], lines):
                if limit is not None and len(requests) >= limit:
                    break
                text = line.strip()
                if not text:
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise TraceFormatError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
                                           ) from None
                if not isinstance(record, dict):
                    raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
                if "kvtier_trace" in record:
                    if requests or kind == "mooncake":
                        raise TraceFormatError(f"{where}: a kvtier_trace header must be the first line")
                    header_block_tokens = record.get("block_tokens", 16)
                    if not _is_int(header_block_tokens) or header_block_tokens <= 0:
                        raise TraceFormatError(f"{where}: block_tokens must be a positive integer, "
                                               f"got {header_block_tokens!r}")
                    kind = "generic"
                    continue
                if kind is None:
                    kind = "mooncake" if "hash_ids" in record else "generic"
                ids: Sequence[int | str]
                if kind == "mooncake":
                    ids, count = _mooncake_request(record, where)
                    sizes.append((where, len(ids), count))
                    seconds = seconds or "chat_id" in record  # Alibaba's Bailian traces: seconds, not ms
                else:
                    bt = block_tokens or header_block_tokens or 16
                    ids, count = _generic_request(record, where, bt)
                requests.append([make_key(i) for i in ids])
                tokens.append(count)
                if stamps is not None:
                    stamp = record.get("timestamp")
                    if (isinstance(stamp, int | float) and not isinstance(stamp, bool)
                            and math.isfinite(stamp)):
                        stamps.append(stamp)
                    else:
                        stamps = None  # not an error: timestamps were never required
    except (UnicodeDecodeError, EOFError, OSError, lzma.LZMAError, zlib.error) as exc:
        raise TraceFormatError(f"{path}: cannot read trace: {_unreadable(exc)}") from None
    if kind is None:
        kind = "generic" if format == "auto" else format
    if kind == "mooncake":
        bt = block_tokens or _mooncake_block_tokens(sizes)
        _check_mooncake_sizes(sizes, bt, inferred=block_tokens is None)
        if stamps and not seconds:
            stamps = [t / 1000 for t in stamps]  # Mooncake's own traces: milliseconds
    else:
        bt = block_tokens or header_block_tokens or 16
    return Trace(name=path.name, format=kind, block_tokens=bt, requests=requests, tokens=tokens,
                 distinct_blocks=len(make_key.keys),
                 timestamps=[t - stamps[0] for t in stamps] if stamps else [])


#: leading bytes of the compressed files a trace may come in (public traces often ship compressed)
_COMPRESSED = ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open))


def _open_text(path: Path) -> IO[str]:
    """``path`` as UTF-8 text lines, through gzip, bz2 or xz when its first bytes say it is compressed."""
    try:
        with path.open("rb") as raw:
            magic = raw.read(6)
        opener = next((op for sig, op in _COMPRESSED if magic.startswith(sig)), None)
        if opener is None:
            return path.open("r", encoding="utf-8")
        return cast("IO[str]", opener(path, "rt", encoding="utf-8"))
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read trace: {exc.strerror or exc}") from None


def _unreadable(exc: BaseException) -> str:
    """Why a trace's bytes could not be read as text, for the error."""
    if isinstance(exc, UnicodeDecodeError):
        return (f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x}): traces are JSONL or CSV, plain or "
                f"gzip/bz2/xz-compressed")
    if isinstance(exc, EOFError):
        return f"the compressed file is truncated ({exc})"
    return str(getattr(exc, "strerror", None) or exc)


def _mooncake_block_tokens(sizes: Sequence[tuple[str, int, int]]) -> int:
    """The tokens per hash id of a Mooncake-format trace that does not say: the block size for which
    every request's ``ceil(input_length / size) == len(hash_ids)``. Mooncake's own traces use 512,
    Alibaba's Bailian (Qwen) traces 16; 512 whenever it fits, else the smallest power of two that
    fits, else the smallest size that does; 512 when none fits (the check then names a line)."""
    lo, hi = 1, math.inf
    for _, n, length in sizes:
        if n:
            lo = max(lo, -(-length // n))
            if n > 1:
                hi = min(hi, (length - 1) // (n - 1))
    if lo <= MOONCAKE_BLOCK_TOKENS <= hi:
        return MOONCAKE_BLOCK_TOKENS
    if lo > hi:
        return MOONCAKE_BLOCK_TOKENS
    power = 1 << (lo - 1).bit_length()
    return power if power <= hi else lo


def _check_mooncake_sizes(sizes: Sequence[tuple[str, int, int]], block_tokens: int, *,
                          inferred: bool) -> None:
    """Every request's hash id count matches its input_length at ``block_tokens`` tokens per id."""
    for where, n, length in sizes:
        if -(-length // block_tokens) != n:
            hint = ("no one block size fits every line of this trace" if inferred
                    else "set --block-tokens to the trace's block size")
            raise TraceFormatError(
                f"{where}: {n} hash_ids for input_length={length}, but {block_tokens} tokens per id "
                f"needs {-(-length // block_tokens)}; {hint}")


# --- Azure CSV (Azure/AzurePublicDataset: TIMESTAMP,ContextTokens,GeneratedTokens) ---------------------

_AZURE_TIME = "timestamp"
#: the prompt-length column of each length-only CSV format (lower case): Azure's, BurstGPT's
_LENGTH_CSV = {"azure": "contexttokens", "burstgpt": "request tokens"}
_DATETIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?",
                       re.ASCII).fullmatch
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII).fullmatch
_PACK_ID = struct.Struct("<Q").pack


def _csv_fields(line: str) -> list[str]:
    """One CSV line's fields, stripped (``csv`` only when the line quotes something)."""
    fields = next(csv.reader([line])) if '"' in line else line.split(",")
    return [f.strip() for f in fields]


def _csv_columns(line: str) -> list[str]:
    return [c.lower() for c in _csv_fields(line.lstrip("\ufeff").rstrip("\r\n"))]


def _length_csv(line: str) -> str | None:
    """The length-only CSV format whose header ``line`` is (a timestamp column and Azure's ContextTokens
    or BurstGPT's Request tokens, any case and order), or None."""
    columns = _csv_columns(line)
    if _AZURE_TIME in columns:
        for name, tokens in _LENGTH_CSV.items():
            if tokens in columns:
                return name
    return None


class _Clock:
    """Timestamps to integer nanoseconds: ``YYYY-MM-DD HH:MM:SS[.fraction]`` (up to 9 fractional
    digits; ``datetime.fromisoformat`` on 3.11 takes at most 6) or plain seconds; one kind per file."""

    def __init__(self) -> None:
        self.days: dict[str, int] = {}
        self.kind: str | None = None

    def __call__(self, text: str) -> int:
        """Nanoseconds since an arbitrary epoch; ValueError with the reason when ``text`` is none of these."""
        m = _DATETIME(text)
        if m is not None:
            kind = "date and time"
            day = self.days.get(text[:10])
            if day is None:
                day = self.days[text[:10]] = datetime.date(int(m[1]), int(m[2]), int(m[3])).toordinal()
            h, mi, sec = int(m[4]), int(m[5]), int(m[6])
            if h > 23 or mi > 59 or sec > 59:
                raise ValueError("time of day out of range")
            frac = m[7]
            ns = ((day * 24 + h) * 60 + mi) * 60 + sec
            ns = ns * 1_000_000_000 + (int(frac) * 10 ** (9 - len(frac)) if frac else 0)
        elif _NUMBER(text) is not None:
            kind = "seconds"
            seconds = float(text)
            if not math.isfinite(seconds) or abs(seconds) > 1e15:
                raise ValueError("seconds out of range")
            ns = round(seconds * 1e9)
        else:
            raise ValueError("expected YYYY-MM-DD HH:MM:SS[.fraction] (at most 9 fractional digits) "
                             "or a number of seconds")
        if self.kind is None:
            self.kind = kind
        elif kind != self.kind:
            raise ValueError(f"a timestamp in {kind} in a file whose first is in {self.kind}")
        return ns


def _read_length_csv(path: Path, first: tuple[int, str] | None, lines: Iterator[tuple[int, str]], *,
                     block_tokens: int | None, limit: int | None) -> Trace:
    """A length-only CSV trace (Azure's TIMESTAMP,ContextTokens,... or BurstGPT's Timestamp,Model,Request
    tokens,...): each request ``ceil(tokens / block_tokens)`` blocks whose ids are new (unique across
    the trace: the file knows nothing of shared prefixes, so none is invented), chained as in the other
    formats by their order in the request; a request of 0 tokens has no blocks (kept, so requests and
    timestamps stay one per row). Output lengths and other columns are not read."""
    bt = block_tokens or AZURE_BLOCK_TOKENS
    if first is None:
        return Trace(name=path.name, format="azure", block_tokens=bt, requests=[], tokens=[],
                     distinct_blocks=0, prefix_information=False)
    header_line, header = first
    kind = _length_csv(header)
    if kind is None:
        raise TraceFormatError(f"{path}:{header_line}: expected a CSV header with TIMESTAMP and "
                               f"ContextTokens (Azure) or Request tokens (BurstGPT) columns, "
                               f"got {header.strip()[:120]!r}")
    names = _csv_fields(header.lstrip("\ufeff").rstrip("\r\n"))
    columns = [n.lower() for n in names]
    width = len(columns)
    t_col, n_col = columns.index(_AZURE_TIME), columns.index(_LENGTH_CSV[kind])
    t_name, n_name = names[t_col], names[n_col]
    clock = _Clock()
    counts: list[int] = []
    stamps: list[int] = []
    for lineno, line in lines:
        if limit is not None and len(counts) >= limit:
            break
        if not line.strip():
            continue
        fields = _csv_fields(line.rstrip("\r\n"))
        if len(fields) != width:
            raise TraceFormatError(f"{path}:{lineno}: expected {width} columns ({', '.join(names)}), "
                                   f"got {len(fields)}")
        count = fields[n_col]
        if not (count.isascii() and count.isdigit()):
            raise TraceFormatError(f"{path}:{lineno}: column {n_name}: expected a non-negative integer, "
                                   f"got {count!r}")
        try:
            stamps.append(clock(fields[t_col]))
        except ValueError as exc:
            raise TraceFormatError(f"{path}:{lineno}: column {t_name}: bad timestamp "
                                   f"{fields[t_col]!r} ({exc})") from None
        counts.append(int(count))
    # ids by range arithmetic: request r's blocks are ids starts[r] .. starts[r+1]-1
    enabled = gc.isenabled()
    gc.disable()  # a million small tuples: the collector would walk them again and again
    try:
        sizes = [-(-c // bt) for c in counts]
        ends = list(itertools.accumulate(sizes))
        total = ends[-1] if ends else 0
        new = tuple.__new__
        raw = zip(map(_PACK_ID, range(total)), itertools.repeat(0))
        keys = list(map(new, itertools.repeat(BlockKey), raw))
        requests = [keys[e - n:e] for e, n in zip(ends, sizes, strict=True)]
    finally:
        if enabled:
            gc.enable()
    t0 = stamps[0] if stamps else 0
    return Trace(name=path.name, format=kind, block_tokens=bt, requests=requests, tokens=counts,
                 distinct_blocks=total, timestamps=[(t - t0) / 1e9 for t in stamps],
                 prefix_information=False)


def _mooncake_request(record: dict[str, Any], where: str) -> tuple[list[int], int]:
    ids = record.get("hash_ids")
    if not isinstance(ids, list):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of block ids, got {ids!r}")
    for i in ids:
        if not _is_int(i) or not 0 <= i < 1 << 64:
            raise TraceFormatError(f"{where}: hash_ids must be integers in [0, 2^64), got {i!r}")
    length = record.get("input_length")
    if not _is_int(length) or length < 0:
        raise TraceFormatError(f"{where}: 'input_length' must be a non-negative integer, got {length!r}")
    return ids, length


def _generic_request(record: dict[str, Any], where: str, block_tokens: int) -> tuple[list[int | str], int]:
    ids = record.get("blocks")
    if not isinstance(ids, list):
        raise TraceFormatError(f"{where}: expected 'blocks': a list of block ids (or a Mooncake line with "
                               f"'hash_ids'), got keys {sorted(record)}")
    for i in ids:
        if _is_int(i):
            if not 0 <= i < 1 << 64:
                raise TraceFormatError(f"{where}: integer block ids must be in [0, 2^64), got {i}")
        elif not isinstance(i, str) or not i:
            raise TraceFormatError(f"{where}: block ids must be integers or non-empty strings, got {i!r}")
    count = record.get("tokens", len(ids) * block_tokens)
    if not _is_int(count) or count < 0 or count > len(ids) * block_tokens:
        raise TraceFormatError(f"{where}: 'tokens' must be an integer in [0, {len(ids) * block_tokens}] "
                               f"({len(ids)} blocks of {block_tokens} tokens), got {count!r}")
    return ids, count


def parse_capacity(spec: str | int, distinct_blocks: int) -> int:
    """``"5%"`` (of the trace's distinct blocks, rounded half up, at least 1) or a block count."""
    text = str(spec).strip()
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if not 0 < share <= 100 or math.isnan(share):
                raise ValueError
            return max(1, math.floor(distinct_blocks * share / 100 + 0.5))
        blocks = int(text)
    except ValueError:
        raise ValueError(f"capacity {spec!r} is neither a block count nor a percentage like 5%") from None
    if blocks <= 0:
        raise ValueError(f"capacity must be a positive number of blocks, got {spec!r}")
    return blocks


# --- results ---------------------------------------------------------------------------------------


@dataclass
class TierResult:
    """What one tier did during a replay, in blocks (bytes = blocks × block bytes)."""

    name: str
    capacity_blocks: int
    hits: int = 0  # prefix blocks served from this tier
    written: int = 0  # stores, demotions in and promotions in
    read: int = 0  # hits served plus demotions out
    evicted: int = 0
    promoted_in: int = 0
    demoted_in: int = 0


@dataclass
class ReplayResult:
    policy: str
    capacities: list[int]
    references: int
    block_hits: int
    prefix_hit_tokens: int
    input_tokens: int
    seconds: float
    block_bytes: int
    tiers: list[TierResult] = field(default_factory=list)

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.references if self.references else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def refs_per_second(self) -> float:
        return self.references / self.seconds if self.seconds > 0 else float("inf")

    @property
    def total_capacity(self) -> int:
        return sum(self.capacities)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "capacity_blocks": self.capacities, "references": self.references,
            "block_hits": self.block_hits, "block_hit_ratio": self.block_hit_ratio,
            "prefix_hit_tokens": self.prefix_hit_tokens, "input_tokens": self.input_tokens,
            "prefix_hit_ratio": self.prefix_hit_ratio, "seconds": self.seconds,
            "refs_per_second": self.refs_per_second, "block_bytes": self.block_bytes,
            "tiers": [{"name": t.name, "capacity_blocks": t.capacity_blocks, "hits": t.hits,
                       "blocks_written": t.written, "blocks_read": t.read, "evicted": t.evicted,
                       "promoted_in": t.promoted_in, "demoted_in": t.demoted_in,
                       "bytes_written": t.written * self.block_bytes, "bytes_read": t.read * self.block_bytes}
                      for t in self.tiers],
        }


# --- the harness -----------------------------------------------------------------------------------


def next_uses(trace: Trace) -> list[int]:
    """For each block reference (requests flattened), the index of the next reference of its key."""
    flat = [key for request in trace.requests for key in request]
    out = [NEVER] * len(flat)
    later: dict[BlockKey, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        key = flat[i]
        out[i] = later.get(key, NEVER)
        later[key] = i
    return out


ProgressFn = Callable[[int], None]


def replay(trace: Trace, policy: str, capacities: Sequence[int], placement: PlacementPolicy | None = None,
           *, bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN, progress: ProgressFn | None = None,
           future: list[int] | None = None,
           make_policy: Callable[[], EvictionPolicy] | None = None) -> ReplayResult:
    """Replay ``trace`` through tiers of ``capacities`` blocks (top first) under one eviction policy.

    ``policy`` is an eviction policy name (``default`` = :data:`DEFAULT_EVICTION`) used in every
    tier, ``min`` for Belady's MIN under these rules or ``belady`` for Belady with bypass (both one
    tier only; ``future`` may pass :func:`next_uses` to save recomputing it). ``placement`` defaults
    to write-back, admit-all, promote-to-top. ``make_policy`` builds each tier's policy object
    instead of the factory (to inspect it after; ``policy`` is then only its label). ``progress`` is
    called with the number of block references done so far, every few hundred requests. Per
    request, as the cache does it: the leading cached blocks are hits (touched, and promoted per the
    placement); the remaining blocks are stored (those still cached somewhere only touched); every
    planned write and demotion then succeeds. A block *hit* is a block cached (in any tier) when its
    request arrives; a *prefix hit* also needs every block before it cached.
    """
    if policy == "default":
        policy = DEFAULT_EVICTION
    if not capacities or any(c <= 0 for c in capacities):
        raise ValueError(f"capacities must be positive block counts, got {list(capacities)}")
    if policy == BELADY_POLICY:
        if len(capacities) != 1:
            raise ValueError("Belady with bypass is defined for one tier; replay it at the total capacity")
        return belady_bypass(trace, capacities[0], future=future, bytes_per_token=bytes_per_token)
    num_tiers = len(capacities)
    if placement is None:
        placement = PlacementPolicy([AdmitAll() for _ in range(num_tiers)])
    elif placement.num_tiers != num_tiers:
        raise ValueError(f"placement has rules for {placement.num_tiers} tiers but {num_tiers} capacities")
    oracle: BeladyPolicy | None = None
    if policy == MIN_POLICY:
        if num_tiers != 1:
            raise ValueError("Belady's MIN is defined for one tier; replay it at the total capacity")
        oracle = BeladyPolicy()
        indexes = [TierIndex("tier0", {0: capacities[0]}, {0: 1}, policies={0: oracle})]
        if future is None:
            future = next_uses(trace)
    else:
        indexes = [TierIndex(f"tier{t}", {0: cap}, {0: 1}, policy,
                             policies=None if make_policy is None else {0: make_policy()})
                   for t, cap in enumerate(capacities)]
    residency = Residency(indexes, placement)
    tiers = [TierResult(index.name, cap) for index, cap in zip(indexes, capacities, strict=True)]
    hits_in = [0] * num_tiers
    block_tokens = trace.block_tokens

    locate_prefix = residency.locate_prefix
    locate = residency.locate
    touch = residency.touch
    plan_store = residency.plan_store
    finish_write = residency.finish_write
    finish_demotion = residency.finish_demotion
    observe = oracle.observe if oracle is not None else None
    entries0 = indexes[0].entries
    get0 = entries0.get
    settle0 = indexes[0].settle
    access_all0 = indexes[0].policies[0].access_all  # the replay's keys are all of group 0
    all_hints = trace.chain_hints()
    tokens = trace.tokens

    block_hits = prefix_tokens = evicted0 = written0 = 0
    done = base = 0
    started = time.perf_counter()
    for r, keys in enumerate(trace.requests):
        n = len(keys)
        if observe is not None:
            assert future is not None
            for j in range(n):
                observe(keys[j], future[base + j])
            base += n
        if num_tiers == 1:
            # locate_prefix and touch, inlined for one tier: the leading READY run is the prefix hit,
            # touched in one call
            k0 = 0
            for key in keys:
                if get0(key) != READY:
                    break
                k0 += 1
            if k0:
                access_all0(keys if k0 == n else keys[:k0])
            if k0 < n:
                if k0:
                    prefix_tokens += k0 * block_tokens
                    rest = keys[k0:]
                    hints = all_hints[r][k0:]
                    block_hits += k0 + [get0(key) for key in keys[k0 + 1:]].count(READY)
                else:
                    rest = keys
                    hints = all_hints[r]
                    block_hits += [get0(key) for key in keys[1:]].count(READY)
                plan = plan_store(rest, hints)
                evicted0 += len(plan.drops[0])
                writes = plan.writes[0]
                written0 += len(writes)
                for i in writes:
                    settle0(rest[i], True)
            elif n:
                prefix_tokens += tokens[r]
                block_hits += n
            hits_in[0] += k0
        else:
            found = locate_prefix(keys)
            k0 = len(found)
            if k0:
                for j in range(k0):
                    touch(found[j], keys[j])
                for t in found:
                    hits_in[t] += 1
                _promote(residency, keys, found, tiers)
                prefix_tokens += k0 * block_tokens if k0 < n else tokens[r]
            if k0 < n:
                rest = keys[k0:] if k0 else keys
                block_hits += k0 + sum(1 for key in rest[1:] if locate(key) is not None)
                plan = plan_store(rest, all_hints[r][k0:])
                _execute(plan, rest, tiers, finish_write, finish_demotion)
            else:
                block_hits += k0
        done += n
        if progress is not None and not r & 255:
            progress(done)
    seconds = time.perf_counter() - started
    if progress is not None:
        progress(done)
    for t, tier in enumerate(tiers):
        tier.hits = hits_in[t]
        tier.read += hits_in[t]
    if num_tiers == 1:
        tiers[0].evicted += evicted0
        tiers[0].written += written0
    return ReplayResult(policy=policy, capacities=list(capacities), references=done, block_hits=block_hits,
                        prefix_hit_tokens=prefix_tokens, input_tokens=trace.input_tokens, seconds=seconds,
                        block_bytes=block_tokens * bytes_per_token, tiers=tiers)


def _execute(plan: Any, keys: Sequence[BlockKey], tiers: list[TierResult],
             finish_write: Callable[[int, BlockKey, bool], None],
             finish_demotion: Callable[[int, int, BlockKey, bool], None]) -> None:
    """Run a plan against nothing: demotions and drops bottom-up, then the writes; all succeed."""
    for t in range(len(tiers) - 1, -1, -1):
        for key, dst in plan.demotions[t]:
            finish_demotion(t, dst, key, True)
            tiers[t].read += 1
            tiers[dst].written += 1
            tiers[dst].demoted_in += 1
        tiers[t].evicted += len(plan.drops[t])
    for t, writes in enumerate(plan.writes):
        tiers[t].written += len(writes)
        for i in writes:
            finish_write(t, keys[i], True)


def chain_hints(keys: Sequence[BlockKey], start: int, stop: int) -> list[InsertHint]:
    """Insert hints for ``keys[start:stop]`` of one request: position, and the previous block as
    predecessor."""
    return [InsertHint(j, -1, keys[j - 1] if j else None) for j in range(start, stop)]


def _promote(residency: Residency, keys: Sequence[BlockKey], found: Sequence[int],
             tiers: list[TierResult]) -> None:
    """Copy lower-tier hits up as the cache does (the same :meth:`Residency.plan_promotion`; from the
    loaded bytes: no extra read)."""
    promotion = residency.plan_promotion(keys, found)
    if promotion is None:
        return
    _execute(promotion.plan, promotion.keys, tiers, residency.finish_write, residency.finish_demotion)
    written = promotion.plan.writes[promotion.target]  # every write succeeds here
    tiers[promotion.target].promoted_in += len(written)
    residency.finish_promotion(promotion, written)


def belady_bypass(trace: Trace, capacity: int, *, future: list[int] | None = None,
                  bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN) -> ReplayResult:
    """Belady's MIN with bypass over the flattened block references, in ``capacity`` blocks.

    A reference to a cached block is a hit; a missing block is cached only if it is referenced
    again, evicting the cached block referenced farthest in the future when that is later than its
    own next reference — otherwise it bypasses the cache. This is the block-hit optimum of a
    single tier; a request's prefix hit is its leading run of hits, so the prefix figure is what
    this schedule gets, not a prefix-hit optimum.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be a positive block count, got {capacity}")
    if future is None:
        future = next_uses(trace)
    cached: dict[BlockKey, int] = {}  # key -> its next reference
    heap: list[tuple[int, BlockKey]] = []  # (-next reference, key); stale entries skipped
    heappush, heappop = heapq.heappush, heapq.heappop
    block_hits = prefix_tokens = written = evicted = 0
    i = 0
    block_tokens = trace.block_tokens
    started = time.perf_counter()
    for r, keys in enumerate(trace.requests):
        leading = True
        k0 = 0
        for key in keys:
            nxt = future[i]
            i += 1
            if key in cached:
                block_hits += 1
                if leading:
                    k0 += 1
            else:
                leading = False
                if nxt == NEVER:
                    continue
                if len(cached) >= capacity:
                    while heap and cached.get(heap[0][1]) != -heap[0][0]:
                        heappop(heap)
                    if -heap[0][0] <= nxt:
                        continue  # every cached block is needed sooner: bypass
                    del cached[heappop(heap)[1]]
                    evicted += 1
                written += 1
            if nxt == NEVER:
                del cached[key]
            else:
                cached[key] = nxt
                heappush(heap, (-nxt, key))
                if len(heap) > 2 * len(cached) + 64:
                    heap = [(-n, k) for k, n in cached.items()]
                    heapq.heapify(heap)
        if k0:
            prefix_tokens += k0 * block_tokens if k0 < len(keys) else trace.tokens[r]
    seconds = time.perf_counter() - started
    tier = TierResult("tier0", capacity, hits=block_hits, written=written, read=block_hits, evicted=evicted)
    return ReplayResult(policy=BELADY_POLICY, capacities=[capacity], references=i, block_hits=block_hits,
                        prefix_hit_tokens=prefix_tokens, input_tokens=trace.input_tokens, seconds=seconds,
                        block_bytes=block_tokens * bytes_per_token, tiers=[tier])


def gap_closed(result: ReplayResult, baseline: ReplayResult, ceiling: ReplayResult) -> float | None:
    """Share of the prefix-hit gap between a baseline and MIN that ``result`` closes (None: no gap, or one
    under 0.0005 — a share of nothing is noise)."""
    gap = ceiling.prefix_hit_ratio - baseline.prefix_hit_ratio
    if gap < 5e-4:
        return None
    return (result.prefix_hit_ratio - baseline.prefix_hit_ratio) / gap


# --- many runs, and their report ---------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One replay to do: an eviction policy over tiers of these capacities (blocks, top first)."""

    policy: str
    capacities: tuple[int, ...]


def plan_runs(policies: Sequence[str], capacities: Sequence[int], tier_sets: Sequence[Sequence[int]] = (),
              *, with_min: bool = True) -> list[RunSpec]:
    """LRU, the requested policies and both ceilings (``min``, ``belady``) at each single-tier
    capacity, then each multi-tier set (ceilings at its total capacity: those of any hierarchy that size)."""
    names: list[str] = ["lru"]
    for p in policies:
        p = DEFAULT_EVICTION if p == "default" else p
        if p not in names and p not in CEILINGS:
            names.append(p)
    runs: list[RunSpec] = []
    for cap in capacities:
        runs.extend(RunSpec(p, (cap,)) for p in names)
        if with_min:
            runs.extend(RunSpec(c, (cap,)) for c in CEILINGS)
    for caps in tier_sets:
        runs.extend(RunSpec(p, tuple(caps)) for p in names)
        if with_min and (sum(caps),) not in {r.capacities for r in runs if r.policy == MIN_POLICY}:
            runs.extend(RunSpec(c, (sum(caps),)) for c in CEILINGS)
    return runs


def run_all(trace: Trace, runs: Sequence[RunSpec], placement: Callable[[int], PlacementPolicy | None],
            *, bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN,
            progress: Callable[[int, str], None] | None = None) -> list[ReplayResult]:
    """Replay each run; ``placement(num_tiers)`` gives fresh placement rules (None: defaults).

    ``progress(references_done_in_this_run, label)`` is called as runs advance.
    """
    future = next_uses(trace) if any(r.policy in CEILINGS for r in runs) else None
    results = []
    for run in runs:
        label = f"{run.policy} @ {'+'.join(map(str, run.capacities))}"
        tick = (lambda done, label=label: progress(done, label)) if progress is not None else None
        rules = None if run.policy in CEILINGS or len(run.capacities) == 1 else placement(len(run.capacities))
        results.append(replay(trace, run.policy, run.capacities, rules, bytes_per_token=bytes_per_token,
                              progress=tick, future=future))
    return results


def _baselines(results: Sequence[ReplayResult], result: ReplayResult) -> tuple[ReplayResult | None,
                                                                               ReplayResult | None]:
    """The better of LRU/ARC with ``result``'s tier capacities, and MIN (replay rules) at its total
    capacity."""
    best = ceiling = None
    for r in results:
        if r.policy == MIN_POLICY and r.capacities == [result.total_capacity]:
            ceiling = r
        elif (r.policy in ("lru", "arc") and r.capacities == result.capacities
              and (best is None or r.prefix_hit_ratio > best.prefix_hit_ratio)):
            best = r
    return best, ceiling


def _closed(results: Sequence[ReplayResult], result: ReplayResult) -> tuple[float | None, str | None]:
    """Share of the gap between the better of LRU/ARC and ``min`` (the replay-rules MIN, the ceiling
    of any policy the cache can run) that ``result`` closes, and that baseline."""
    if result.policy in ("lru", "arc", *CEILINGS):
        return None, None
    best, ceiling = _baselines(results, result)
    if best is None or ceiling is None:
        return None, None
    return gap_closed(result, best, ceiling), best.policy


def trace_note(trace: Trace) -> dict[str, Any]:
    """What the results of ``trace`` can and cannot say, for under the table and for ``--json``.

    ``note`` is None unless the hit ratios are 0 by construction: a format without prefix information
    (Azure CSV), or a trace in which no block id repeats.
    """
    duration = trace.duration_seconds
    n = len(trace.requests)
    rate = n / duration if duration else None
    note = None
    if trace.references and (not trace.prefix_information or trace.distinct_blocks == trace.references):
        why = (f"the {trace.format} format has arrival times and lengths only, no prefix information, so "
               f"every block of every request gets an id of its own"
               if not trace.prefix_information else "no block id occurs twice in this trace")
        arrivals = (f"{n:,} requests over {duration:,.0f} s, {rate:.2f}/s"
                    if duration and rate is not None else f"{n:,} requests, no timestamps")
        note = (f"every hit ratio here is 0 by construction: {why}, and a block never seen before "
                f"cannot hit — for every policy and both ceilings, so the table says nothing about the "
                f"policies. Still good for: the arrival pattern ({arrivals}); write volume (all "
                f"{trace.references:,} block references miss; what fits is stored, see written per "
                f"tier; belady bypasses them all); tier churn (evictions once a tier is full).")
    return {"format": trace.format, "prefix_information": trace.prefix_information, "requests": n,
            "duration_seconds": duration, "requests_per_second": rate, "note": note}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def results_table(trace: Trace, results: Sequence[ReplayResult]) -> Any:
    """A :class:`rich.table.Table` of the results, grouped by capacity, baselines and MIN beside."""
    from rich.markup import escape
    from rich.table import Table

    multi = any(len(r.capacities) > 1 for r in results)
    table = Table(title=f"{escape(trace.name)}: {len(trace.requests):,} requests, "
                        f"{trace.references:,} block references, "
                        f"{trace.distinct_blocks:,} distinct blocks of {trace.block_tokens} tokens",
                  title_justify="left")
    table.add_column("capacity (blocks)", justify="right")
    table.add_column("policy")
    table.add_column("block hit", justify="right")
    table.add_column("prefix-hit tokens", justify="right")
    table.add_column("vs LRU", justify="right")
    table.add_column("gap to min closed", justify="right")
    if multi:
        table.add_column("hits per tier", justify="right")
    table.add_column("written per tier", justify="right")
    table.add_column("read per tier", justify="right")
    table.add_column("refs/s", justify="right")
    previous = None
    for r in results:
        shape = tuple(r.capacities)
        if previous is not None and shape != previous:
            table.add_section()
        previous = shape
        lru = next((x for x in results if x.policy == "lru" and tuple(x.capacities) == shape), None)
        share, baseline = _closed(results, r)
        # a policy row with a baseline but no share: MIN is no better than it (0 % of nothing is not 0 %)
        closed = (f"{share:.0%} (from {baseline})" if share is not None else
                  "n/a (no gap)" if baseline is not None else "")
        delta = "" if lru is None or r is lru else f"{r.prefix_hit_ratio - lru.prefix_hit_ratio:+.4f}"
        pct = "+".join(f"{c:,} ({100 * c / max(1, trace.distinct_blocks):.3g}%)" for c in r.capacities)
        row = [pct, r.policy, f"{r.block_hit_ratio:.4f}", f"{r.prefix_hit_ratio:.4f}", delta, closed]
        if multi:
            row.append(" / ".join(f"{t.hits:,}" for t in r.tiers))
        row.append(" / ".join(_size(t.written * r.block_bytes) for t in r.tiers))
        row.append(" / ".join(_size(t.read * r.block_bytes) for t in r.tiers))
        row.append(f"{r.refs_per_second / 1000:,.0f}k")
        table.add_row(*row, style="dim" if r.policy in CEILINGS else None)
    return table


def results_json(trace: Trace, results: Sequence[ReplayResult]) -> dict[str, Any]:
    """Everything in the table, for machines (ratios unrounded, sizes in blocks and bytes)."""
    out = []
    for r in results:
        item = r.to_dict()
        item["capacity_share"] = [c / max(1, trace.distinct_blocks) for c in r.capacities]
        item["gap_closed"], item["gap_baseline"] = _closed(results, r)
        item["gap_ceiling"] = MIN_POLICY if item["gap_closed"] is not None else None
        out.append(item)
    return {"trace": trace.summary(), "trace_note": trace_note(trace), "default_policy": DEFAULT_EVICTION,
            "results": out}


def check_plot_target(path: str | Path) -> None:
    """Refuse a plot that would fail after the replay: no matplotlib, an unknown format, an unwritable folder.

    Raises :class:`kvtier.extras.MissingExtra` or ``ValueError`` naming the problem.
    """
    import os

    from kvtier.extras import require

    require("matplotlib")
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{str(out)!r} is a directory; give a file name such as {str(out / 'replay.png')!r}")
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in formats:
        problem = "no file extension" if not suffix else f".{suffix} is not a format matplotlib writes"
        raise ValueError(f"{str(out)!r}: {problem}; "
                         f"use .png, .svg or .pdf (or one of {', '.join(sorted(formats))})")
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"cannot write {str(out)!r}: {str(folder)!r} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {str(out)!r}: no write permission in {str(folder)!r}")


def plot_results(trace: Trace, results: Sequence[ReplayResult], path: str | Path) -> Path:
    """Hit ratio against capacity (% of distinct blocks, log scale), one line per policy; PNG/SVG/PDF."""
    from kvtier.extras import require

    matplotlib = require("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single = [r for r in results if len(r.capacities) == 1]
    shown = single or list(results)
    policies = list(dict.fromkeys(r.policy for r in shown))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, (attr, label) in zip(axes, (("prefix_hit_ratio", "prefix-hit token ratio"),
                                        ("block_hit_ratio", "block hit ratio")), strict=True):
        for policy in policies:
            points = sorted((100 * r.total_capacity / max(1, trace.distinct_blocks), getattr(r, attr))
                            for r in shown if r.policy == policy)
            xs, ys = zip(*points, strict=True)
            style = ({"color": "black", "linestyle": "--"} if policy == MIN_POLICY else
                     {"color": "grey", "linestyle": ":"} if policy == BELADY_POLICY else {})
            name = f"{policy} (default)" if policy == DEFAULT_EVICTION else policy
            name = {MIN_POLICY: "MIN (replay rules)", BELADY_POLICY: "Belady with bypass"}.get(policy, name)
            ax.plot(xs, ys, marker="o", label=name, **style)
        ax.set_xscale("log")
        shares = sorted({100 * r.total_capacity / max(1, trace.distinct_blocks) for r in shown})
        ax.set_xticks(shares, [f"{x:.3g}" for x in shares])
        ax.minorticks_off()
        ax.set_xlabel("capacity (% of distinct blocks)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(loc="lower right", fontsize="small")
    fig.suptitle(f"{trace.name} ({trace.references:,} block references)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
