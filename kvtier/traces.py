"""Request traces: what ``kvtier replay`` and the policy benchmarks read, in every format kvtier knows.

A :class:`Trace` is a list of requests, each the block keys of its prompt in order (equal ids share one
key object; a block's predecessor is the block before it in its request), with token counts and, where
the file has them, arrival times. :func:`read_trace` reads Mooncake JSONL (any block size, read off
the file), kvtier's generic JSONL, and the length-only CSVs of Azure and BurstGPT, plain or gzip/bz2/xz
compressed; every fault is a :class:`TraceFormatError` naming the file and line. docs/policies.md
describes the formats.
"""

from __future__ import annotations

import bz2
import csv
import datetime
import gc
import gzip
import hashlib
import itertools
import json
import lzma
import math
import re
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeGuard, cast

from kvtier.blocks import BlockKey
from kvtier.errors import KVTierError
from kvtier.policy import InsertHint

#: Tokens per hash id in Mooncake's own traces (a Mooncake-format file's own size is read off its lines).
MOONCAKE_BLOCK_TOKENS = 512
#: Tokens per block of a length-only CSV trace (it has no blocks of its own; 16 as vLLM's default).
AZURE_BLOCK_TOKENS = 16
#: What ``read_trace(format=...)`` and ``kvtier replay --format`` take.
TRACE_FORMATS = ("auto", "mooncake", "generic", "azure", "burstgpt")

#: What holding a trace and replaying it costs in memory, measured (CPython 3.11, ``kvtier replay``'s
#: default runs, docs/policies.md) and rounded up: per block reference (request lists, the next-use
#: table MIN needs while it is built), per distinct block (its key and chain hint) and per block
#: resident in the largest hierarchy replayed (index entry and the `adaptive` policy's state, its
#: ghost history included; LRU needs a third of it).
REPLAY_BYTES_BASE = 40 << 20
REPLAY_BYTES_PER_REFERENCE = 110
REPLAY_BYTES_PER_DISTINCT = 220
REPLAY_BYTES_PER_RESIDENT = 1400
#: The share of distinct blocks the reader's check assumes resident (the default capacities' largest).
_DEFAULT_RESIDENT_SHARE = 0.25


def replay_memory(references: int, distinct: int, resident: int) -> int:
    """Bytes that holding a trace of ``references`` block references (``distinct`` blocks) and
    replaying it with at most ``resident`` blocks cached takes, about (an upper estimate)."""
    return (REPLAY_BYTES_BASE + REPLAY_BYTES_PER_REFERENCE * references
            + REPLAY_BYTES_PER_DISTINCT * distinct + REPLAY_BYTES_PER_RESIDENT * resident)


class TraceFormatError(KVTierError, ValueError):
    """A trace line is malformed; the message starts with ``path:line``."""


class TraceTooLargeError(KVTierError, ValueError):
    """Replaying the trace would take more memory than there is; ``limit`` leading requests would fit.

    Raised before the memory is spent (an out-of-memory kill an hour into a replay says nothing)."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


def check_replay_memory(name: str | Path, requests: int, references: int, distinct: int, resident: int,
                        budget: int, *, more: bool = False) -> None:
    """Raise :class:`TraceTooLargeError` when replaying ``requests`` (``references`` block references,
    ``distinct`` blocks, at most ``resident`` cached) needs more than ``budget`` bytes
    (:func:`replay_memory`); the error names the sizes and the ``--limit`` that fits (requests scaled
    down to the budget, with a tenth to spare). ``more``: the reader stopped early, there is more."""
    need = replay_memory(references, distinct, resident)
    if need <= budget:
        return
    limit = max(0, int(requests * budget / need * 0.9))
    raise TraceTooLargeError(
        f"{name}: {'more than ' if more else ''}{references:,} block references ({distinct:,} distinct) "
        f"in {'the first ' if more else ''}{requests:,} requests need about {_bytes(need)} to replay and "
        f"{_bytes(budget)} is available; replay the first requests with --limit {limit}", limit)


def _bytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


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
        if self._hints is None and not self.prefix_information:
            # every block id is new: no hint recurs, so a table to share them would only cost memory
            # (~100 bytes per reference, on traces of tens of millions of references)
            new = tuple.__new__
            self._hints = [[new(InsertHint, (j, -1, pred))
                            for j, pred in zip(range(len(keys)), [None, *keys], strict=False)]
                           for keys in self.requests]
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
               limit: int | None = None, memory_budget: int | None = None) -> Trace:
    """Read a Mooncake or generic JSONL trace, or an Azure or BurstGPT CSV trace, plain or gzip/bz2/xz
    compressed (see docs/policies.md).

    ``format`` is ``auto`` (a CSV header on the first non-empty line, else decided by the first
    request line), ``mooncake``, ``generic``, ``azure`` or ``burstgpt``. ``block_tokens`` defaults to
    what the format says (a Mooncake-format file: read off its lines). ``limit`` keeps the first N
    requests. Raises :class:`TraceFormatError` naming the file (and line). With ``memory_budget``
    (bytes), reading stops with :class:`TraceTooLargeError` as soon as replaying what it has read
    would take more (:func:`replay_memory`, a quarter of the distinct blocks resident), before the
    keys of a length-only CSV are built.
    """
    if format not in TRACE_FORMATS:
        raise ValueError(f"format must be one of {', '.join(map(repr, TRACE_FORMATS))}, got {format!r}")
    if block_tokens is not None and block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if memory_budget is not None and memory_budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget}")
    path = Path(path)
    try:
        with _open_text(path) as handle:
            lines = enumerate(handle, 1)
            first = next(((n, line) for n, line in lines if line.strip()), None)
            if format in _LENGTH_CSV or (format == "auto" and first is not None and _length_csv(first[1])):
                return _read_length_csv(path, first, lines, block_tokens=block_tokens, limit=limit,
                                        budget=memory_budget)
            rest = itertools.chain([first] if first is not None else [], lines)
            return _read_jsonl(path, rest, format=format, block_tokens=block_tokens, limit=limit,
                               budget=memory_budget)
    except (UnicodeDecodeError, EOFError, OSError, lzma.LZMAError, zlib.error) as exc:
        raise TraceFormatError(f"{path}: cannot read trace: {_unreadable(exc)}") from None


def _read_jsonl(path: Path, lines: Iterator[tuple[int, str]], *, format: str, block_tokens: int | None,
                limit: int | None, budget: int | None) -> Trace:
    """A Mooncake or generic JSONL trace (``format`` ``auto`` decides by the first request line)."""
    make_key = _KeyMaker()
    requests: list[list[BlockKey]] = []
    tokens: list[int] = []
    kind = None if format == "auto" else format
    header_block_tokens: int | None = None
    stamps: list[float] | None = []  # None once a request has no usable timestamp
    sizes: list[tuple[str, int, int]] = []  # Mooncake format: (where, hash ids, input_length) per request
    seconds = False  # Mooncake format: timestamps in seconds (Bailian), not milliseconds
    references = 0  # counted only against a memory budget
    for lineno, line in lines:
        if limit is not None and len(requests) >= limit:
            break
        text = line.strip()
        if not text:
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
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
            ids, count = _generic_request(record, where, block_tokens or header_block_tokens or 16)
        requests.append([make_key(i) for i in ids])
        tokens.append(count)
        if budget is not None:
            references += len(ids)
            distinct = len(make_key.keys)
            check_replay_memory(path, len(requests), references, distinct,
                                int(distinct * _DEFAULT_RESIDENT_SHARE), budget, more=True)
        if stamps is not None:
            stamp = record.get("timestamp")
            if isinstance(stamp, int | float) and not isinstance(stamp, bool) and math.isfinite(stamp):
                stamps.append(stamp)
            else:
                stamps = None  # not an error: timestamps were never required
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
                     block_tokens: int | None, limit: int | None, budget: int | None) -> Trace:
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
        if budget is not None:  # every block is distinct: check before a key is built
            check_replay_memory(path, len(counts), total, total, int(total * _DEFAULT_RESIDENT_SHARE), budget)
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
