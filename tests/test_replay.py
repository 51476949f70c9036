"""``kvtier replay``: trace readers, the harness's numbers on fixtures, errors, and the command."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.cli import main
from kvtier.policy import DEFAULT_EVICTION, EVICTION_POLICIES, InsertHint
from kvtier.replay import (
    gap_closed,
    next_uses,
    parse_capacity,
    plan_runs,
    replay,
    results_json,
    results_table,
    run_all,
    trace_note,
)
from kvtier.traces import Trace, TraceFormatError, TraceTooLargeError, read_trace, replay_memory

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "mooncake_tiny.jsonl"
SLICE = FIXTURES / "mooncake_slice.jsonl"


def test_mooncake_reader() -> None:
    trace = read_trace(TINY)
    assert trace.format == "mooncake" and trace.block_tokens == 512
    assert len(trace.requests) == 6  # the blank line is skipped
    assert trace.references == 20 and trace.distinct_blocks == 8 and trace.input_tokens == 9700
    assert trace.requests[0][0] is trace.requests[5][0]  # one key object per id
    assert len(read_trace(TINY, limit=2).requests) == 2


def test_tiny_trace_gives_the_numbers_worked_out_by_hand() -> None:
    """Capacity 4, LRU: see the request-by-request walk in the fixture's comment below."""
    # r0 stores 0,1,2 | r1 hits 0,1 (1024 tokens), stores 3 | r2 hits 0 (512), stores 4 over 2 |
    # r3 hits 0,1 (1024), stores 2,5 over 3,4 | r4 hits 0 (512), stores 4,6 over 1,2 |
    # r5 hits 0 (512) and block 5 beyond the prefix, stores 1,2,5,7 over 5,4,6,0.
    result = replay(read_trace(TINY), "lru", [4])
    assert (result.block_hits, result.references) == (8, 20)
    assert (result.prefix_hit_tokens, result.input_tokens) == (3584, 9700)
    assert result.tiers[0].hits == 7 and result.tiers[0].written == 13 and result.tiers[0].evicted == 9
    best = replay(read_trace(TINY), "min", [4])
    assert (best.block_hits, best.prefix_hit_tokens) == (11, 5120)


def test_mooncake_slice_known_numbers() -> None:
    trace = read_trace(SLICE)
    assert (len(trace.requests), trace.references, trace.distinct_blocks) == (300, 7710, 7069)
    got = {p: replay(trace, p, [400]) for p in ("lru", "arc", "min")}
    assert (got["lru"].block_hits, got["lru"].prefix_hit_tokens) == (352, 180224)
    assert (got["arc"].block_hits, got["arc"].prefix_hit_tokens) == (405, 207360)
    assert (got["min"].block_hits, got["min"].prefix_hit_tokens) == (595, 304640)
    for policy in EVICTION_POLICIES:  # every policy lies between block 0 alone and MIN
        result = replay(trace, policy, [400])
        assert 299 <= result.block_hits <= got["min"].block_hits


def test_generic_format(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"kvtier_trace": 1, "block_tokens": 4}\n'
                    '{"blocks": [1, 2, 3], "tokens": 10, "timestamp": 0.5}\n'
                    '{"blocks": ["sys", "a1"]}\n'
                    '{"blocks": [1, 2, 9], "tokens": 12}\n')
    trace = read_trace(path)
    assert trace.format == "generic" and trace.block_tokens == 4
    assert trace.tokens == [10, 8, 12] and trace.distinct_blocks == 6
    result = replay(trace, "lru", [10])
    assert result.block_hits == 2 and result.prefix_hit_tokens == 8


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"hash_ids": "12", "input_length": 5}', "'hash_ids' must be a list"),
    ('{"hash_ids": [1, -2], "input_length": 600}', "integers in [0, 2^64)"),
    ('{"hash_ids": [1, 2], "input_length": "long"}', "'input_length' must be"),
    ('{"hash_ids": [1, 2, 3], "input_length": 60}', "no one block size fits every line"),
    ('{"hash_ids": [1], "input_length": 100}\n{"blocks": [1]}', "'hash_ids' must be a list"),
    ('{"blocks": [1, true]}', "block ids must be integers or non-empty strings"),
    ('{"blocks": [1, 2], "tokens": 1000}', "'tokens' must be an integer in [0, 32]"),
    ('{"prompt": "hello"}', "expected 'blocks'"),
    ('{"blocks": [1]}\n{"kvtier_trace": 1}', "header must be the first line"),
])
def test_bad_lines_are_reported_with_their_line_number(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [7], "input_length": 100}\n\n' + line + "\n"
                    if "hash_ids" in line.split("\n")[0] or "header" in message else line + "\n")
    lineno = 3 if "hash_ids" in line.split("\n")[0] or "header" in message else 1
    if "\n" in line:
        lineno += 1
    if "header" in message:
        path.write_text(line + "\n")
        lineno = 2
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}:{lineno}: "), str(info.value)
    assert message in str(info.value)


def test_a_block_size_given_that_does_not_fit_names_the_line_and_the_option(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [1], "input_length": 100}\n{"hash_ids": [1, 2], "input_length": 2000}\n')
    with pytest.raises(TraceFormatError, match=rf"^{re.escape(str(path))}:2: .*set --block-tokens"):
        read_trace(path, block_tokens=512)


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress])
def test_compressed_traces_read_as_the_plain_file(tmp_path: Path, compress: Callable[[bytes], bytes]) -> None:
    text = ('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n'
            '{"timestamp": 5, "input_length": 100, "hash_ids": [1]}\n')
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.z"
    plain.write_text(text)
    packed.write_bytes(compress(text.encode()))
    assert read_trace(packed).requests == read_trace(plain).requests
    csv_text = "TIMESTAMP,ContextTokens\n1,40\n2,3\n"
    (tmp_path / "a.csv.z").write_bytes(compress(csv_text.encode()))
    assert [len(r) for r in read_trace(tmp_path / "a.csv.z").requests] == [3, 1]


def test_unreadable_trace_files_are_named_errors(tmp_path: Path) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x00\xd0\xff" * 100)
    with pytest.raises(TraceFormatError, match=r"model\.bin: cannot read trace: not UTF-8 text"):
        read_trace(binary)
    truncated = tmp_path / "t.jsonl.gz"
    truncated.write_bytes(gzip.compress(b'{"blocks": [1, 2]}\n' * 5000)[:200])
    with pytest.raises(TraceFormatError, match=r"gz: cannot read trace: the compressed file is truncated"):
        read_trace(truncated)
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        read_trace(tmp_path)  # a folder


def test_mooncake_format_at_another_block_size_is_inferred(tmp_path: Path) -> None:
    """Alibaba's Bailian (Qwen) traces are Mooncake lines at 16 tokens per hash id, in seconds."""
    path = tmp_path / "qwen_traceA_blksz_16.jsonl"
    rows = [{"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 521,
             "output_length": 132, "type": "text", "turn": 1, "hash_ids": list(range(33))},
            {"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5, "input_length": 600,
             "output_length": 80, "type": "text", "turn": 2, "hash_ids": list(range(38))}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = read_trace(path)
    assert (trace.format, trace.block_tokens) == ("mooncake", 16)
    assert trace.requests[1][:33] == trace.requests[0]  # the second turn continues the first's prefix
    assert trace.timestamps == pytest.approx([0.0, 1.386])
    mooncake = tmp_path / "m.jsonl"  # Mooncake's own: 512 tokens per id, milliseconds
    mooncake.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n'
                        '{"timestamp": 2500, "input_length": 100, "hash_ids": [1]}\n')
    trace = read_trace(mooncake)
    assert trace.block_tokens == 512 and trace.timestamps == [0.0, 2.5]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 4, 16, 64, 512, 1024]),
       st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=20))
def test_the_inferred_block_size_fits_every_line(tmp_path_factory: pytest.TempPathFactory, size: int,
                                                 lengths: list[int]) -> None:
    path = tmp_path_factory.mktemp("bs") / "t.jsonl"
    path.write_text("".join(json.dumps({"input_length": n, "hash_ids": list(range(-(-n // size)))}) + "\n"
                            for n in lengths))
    trace = read_trace(path)
    assert [len(r) for r in trace.requests] == [-(-n // trace.block_tokens) for n in lengths]


def test_missing_trace_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")


def test_capacities() -> None:
    assert parse_capacity("1%", 182_790) == 1828
    assert parse_capacity("5%", 182_790) == 9140
    assert parse_capacity("25%", 182_790) == 45698
    assert parse_capacity("0.0001%", 10) == 1
    assert parse_capacity("18279", 10) == 18279
    for bad in ("0", "-3", "0%", "101%", "lots", "nan%"):
        with pytest.raises(ValueError, match="capacity"):
            parse_capacity(bad, 100)


def test_runs_always_include_lru_and_both_ceilings() -> None:
    runs = plan_runs(["arc", "default"], [10, 20], [[5, 15]])
    assert [(r.policy, r.capacities) for r in runs][:5] == [("lru", (10,)), ("arc", (10,)),
                                                            (DEFAULT_EVICTION, (10,)), ("min", (10,)),
                                                            ("belady", (10,))]
    assert ("min", (20,)) in [(r.policy, r.capacities) for r in runs]  # the ceilings of 5+15
    assert ("belady", (20,)) in [(r.policy, r.capacities) for r in runs]
    assert [r.policy for r in runs if r.capacities == (5, 15)] == ["lru", "arc", DEFAULT_EVICTION]


def test_next_uses_and_gap_closed() -> None:
    trace = read_trace(TINY)
    uses = next_uses(trace)
    assert uses[0] == 3  # block 0 is next referenced by request 1, whose first block is reference 3
    results = run_all(trace, plan_runs(["lifetime"], [4]), lambda n: None)
    lru, default, ceiling = results[0], results[1], results[2]
    assert gap_closed(lru, lru, ceiling) == 0.0
    assert gap_closed(ceiling, lru, ceiling) == 1.0
    doc = results_json(trace, results)
    assert doc["trace"]["block_references"] == 20
    assert [r["policy"] for r in doc["results"]] == ["lru", "lifetime", "min", "belady"]
    assert doc["results"][0]["gap_closed"] is None and doc["results"][1]["gap_baseline"] == "lru"
    assert doc["results"][1]["gap_ceiling"] == "min"
    assert default.references == 20


def test_ceilings_are_single_tier_only() -> None:
    with pytest.raises(ValueError, match="one tier"):
        replay(read_trace(TINY), "min", [2, 4])
    with pytest.raises(ValueError, match="one tier"):
        replay(read_trace(TINY), "belady", [2, 4])


def _brute_belady_bypass(flat: list[BlockKey], capacity: int) -> int:
    """Block hits of Belady with bypass, by definition (quadratic)."""
    cached: set[BlockKey] = set()
    hits = 0
    for i, key in enumerate(flat):
        def next_use(k: BlockKey, after: int = i) -> float:
            return next((j for j in range(after + 1, len(flat)) if flat[j] == k), float("inf"))
        if key in cached:
            hits += 1
        else:
            cached.add(key)
        if next_use(key) == float("inf"):
            cached.discard(key)
        elif len(cached) > capacity:
            cached.discard(max(cached, key=next_use))
    return hits


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=5, unique=True), min_size=1, max_size=40),
       st.integers(1, 6))
def test_belady_with_bypass_is_the_block_hit_optimum(requests: list[list[int]], capacity: int) -> None:
    keys = [BlockKey(i.to_bytes(8, "little"), 0) for i in range(13)]
    trace = Trace("t", "synthetic", 16, [[keys[i] for i in r] for r in requests],
                  [16 * len(r) for r in requests], 13)
    bypass = replay(trace, "belady", [capacity])
    assert bypass.block_hits == _brute_belady_bypass([k for r in trace.requests for k in r], capacity)
    assert bypass.tiers[0].written <= bypass.references - bypass.block_hits  # a bypassed miss writes nothing


def test_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["replay", str(TINY), "--capacity", "4", "50%", "--policy", "arc", "default", "--json",
                 "--no-progress"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["capacity_blocks"]) for r in doc["results"]] == [
        ("lru", [4]), ("arc", [4]), (DEFAULT_EVICTION, [4]), ("min", [4]), ("belady", [4]),
        ("lru", [4]), ("arc", [4]), (DEFAULT_EVICTION, [4]), ("min", [4]), ("belady", [4])]
    assert doc["results"][0]["block_hit_ratio"] == 0.4


def test_command_table_plot_and_tiers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "plot.png"
    code = main(["replay", str(SLICE), "--capacity", "1%", "5%", "--tiers", "1%,5%", "--admission", "tinylfu",
                 "--plot", str(plot)])
    assert code == 0
    out = capsys.readouterr().out
    assert "prefix-hit tokens" in out and "min" in out and "hits per tier" in out
    assert plot.stat().st_size > 10_000


@pytest.mark.parametrize(("args", "message"), [
    (["--policy", "clairvoyant"], "unknown policy"),
    (["--capacity", "0"], "capacity"),
    (["--tiers", "10"], "two or more"),
    (["--tiers", "1,2", "--admission", "a,b,c"], "--admission"),
    (["--tiers", "1,2", "--admission", "third_sighting"], "--admission[1]"),
    (["--tiers", "1,2", "--promote-to", "5"], "promote_to"),
])
def test_command_rejects_bad_arguments(args: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(TINY), "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


def test_command_reports_a_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1], "input_length": 10}\n{"hash_ids": [1], "input_length": -1}\n')
    assert main(["replay", str(bad), "--no-progress"]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err


# --- Azure CSV ------------------------------------------------------------------------------------------

AZURE_ROWS = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.6805900,374,44\n"
              "2023-11-16 18:15:50.9951690,396,109\n"
              "\n"
              "2023-11-16 18:15:51.2224670,16,1\n")


def _csv(tmp_path: Path, text: str, name: str = "azure.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_csv_is_detected_and_cut_into_new_chained_blocks(tmp_path: Path) -> None:
    trace = read_trace(_csv(tmp_path, AZURE_ROWS))
    assert trace.format == "azure" and trace.block_tokens == 16 and not trace.prefix_information
    assert [len(r) for r in trace.requests] == [24, 25, 1]  # ceil(374/16), ceil(396/16), 16/16
    assert trace.tokens == [374, 396, 16] and trace.input_tokens == 786
    assert trace.references == trace.distinct_blocks == 50
    assert len({k for r in trace.requests for k in r}) == 50  # no id shared, within or across requests
    # chained as the other formats: block j's predecessor is block j-1 of the same request
    hints = trace.chain_hints()
    assert hints[1][0].predecessor is None and hints[1][3].predecessor is trace.requests[1][2]
    assert trace.timestamps == [0.0, 4.314579, 4.541877]  # 7 fractional digits, relative to the first
    assert trace.duration_seconds == pytest.approx(4.541877)
    assert [len(r) for r in read_trace(_csv(tmp_path, AZURE_ROWS), block_tokens=100).requests] == [4, 4, 1]
    assert len(read_trace(_csv(tmp_path, AZURE_ROWS), limit=2).requests) == 2


def test_azure_header_in_any_case_and_order_with_extra_columns(tmp_path: Path) -> None:
    path = _csv(tmp_path, "\ufeff generatedtokens , contexttokens,region,timestamp\n"
                          "5,17,eu,2023-01-31 23:59:59.999999999\n"
                          "6,0,us,2023-02-01 00:00:00.5\n"
                          '7,"33",eu,2023-02-01T00:00:01\n')
    trace = read_trace(path)
    assert trace.format == "azure" and trace.tokens == [17, 0, 33]
    assert [len(r) for r in trace.requests] == [2, 0, 3]  # 0 tokens: a request with no blocks
    assert trace.timestamps == [0.0, 0.500000001, 1.000000001]
    result = replay(trace, "lru", [2])  # an empty request replays as nothing
    assert result.references == 5 and result.block_hits == 0 and result.prefix_hit_tokens == 0


def test_azure_plain_seconds_and_forced_format(tmp_path: Path) -> None:
    trace = read_trace(_csv(tmp_path, "TIMESTAMP,ContextTokens\n100.25,32\n101,1\n1.2e2,2\n"), format="azure")
    assert trace.timestamps == [0.0, 0.75, 19.75] and [len(r) for r in trace.requests] == [2, 1, 1]
    with pytest.raises(TraceFormatError, match=r"huge\.csv:3: column TIMESTAMP: bad timestamp '1e999'"):
        read_trace(_csv(tmp_path, "TIMESTAMP,ContextTokens\n1,2\n1e999,2\n", "huge.csv"))
    assert read_trace(_csv(tmp_path, "", "empty.csv"), format="azure").requests == []
    with pytest.raises(TraceFormatError, match=r"empty\.jsonl:2: expected a CSV header"):
        read_trace(_csv(tmp_path, '\n{"blocks": [1]}\n', "empty.jsonl"), format="azure")


def test_burstgpt_csv_is_read_like_azure(tmp_path: Path) -> None:
    """BurstGPT's Timestamp,Model,Request tokens,...: seconds, lengths, no prefix information."""
    path = _csv(tmp_path, "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                          "5,ChatGPT,472,18,490,Conversation log\n"
                          "45,GPT-4,0,20,20,API log\n"
                          "118,GPT-4,417,276,693,Conversation log\n", "BurstGPT_1.csv")
    trace = read_trace(path)
    assert (trace.format, trace.block_tokens, trace.prefix_information) == ("burstgpt", 16, False)
    assert trace.tokens == [472, 0, 417] and [len(r) for r in trace.requests] == [30, 0, 27]
    assert trace.timestamps == [0.0, 40.0, 113.0] and trace.distinct_blocks == 57
    assert read_trace(path, format="burstgpt").requests == trace.requests
    with pytest.raises(TraceFormatError, match=r"BurstGPT_1\.csv:3: column Request tokens: .*'-1'"):
        read_trace(_csv(tmp_path, "Timestamp,Request tokens\n1,2\n2,-1\n", "BurstGPT_1.csv"))


@pytest.mark.parametrize(("row", "column", "value"), [
    ("2023-11-16 18:15:46.1,-3,4", "ContextTokens", "'-3'"),
    ("2023-11-16 18:15:46.1,1.5,4", "ContextTokens", "'1.5'"),
    ("2023-11-16 18:15:46.1,,4", "ContextTokens", "''"),
    ("2023-11-16 18:15:46.1,many,4", "ContextTokens", "'many'"),
    ("2023-11-16 25:15:46.1,3,4", "TIMESTAMP", "'2023-11-16 25:15:46.1'"),
    ("2023-13-16 18:15:46.1,3,4", "TIMESTAMP", "'2023-13-16 18:15:46.1'"),
    ("2023-11-16 18:15:46.1234567890,3,4", "TIMESTAMP", "'2023-11-16 18:15:46.1234567890'"),
    ("16/11/2023 18:15,3,4", "TIMESTAMP", "'16/11/2023 18:15'"),
    ("17.5,3,4", "TIMESTAMP", "'17.5'"),  # seconds in a file whose first timestamp is a date
    ("2023-11-16 18:15:46.1,3", None, "expected 3 columns"),
    ("2023-11-16 18:15:46.1,3,4,5", None, "got 4"),
])
def test_azure_bad_rows_name_line_column_and_value(tmp_path: Path, row: str, column: str | None,
                                                   value: str) -> None:
    header = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:40,10,1\n\n"
    path = _csv(tmp_path, header + row + "\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:4: "), message
    if column is not None:
        assert f"column {column}:" in message
    assert value in message


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 3000), max_size=40), st.integers(1, 600))
def test_azure_block_counts_and_unique_ids(tmp_path_factory: pytest.TempPathFactory, counts: list[int],
                                           block_tokens: int) -> None:
    rows = "".join(f"{i}.5,{c},1\n" for i, c in enumerate(counts))
    path = tmp_path_factory.mktemp("azure") / "t.csv"
    path.write_text("Timestamp,ContextTokens,GeneratedTokens\n" + rows)
    trace = read_trace(path, block_tokens=block_tokens)
    assert [len(r) for r in trace.requests] == [math.ceil(c / block_tokens) for c in counts]
    assert trace.tokens == counts
    flat = [k for r in trace.requests for k in r]
    assert len(set(flat)) == len(flat) == trace.distinct_blocks == trace.references
    assert trace.timestamps == [float(i) for i in range(len(counts))]
    assert trace.chain_hints() == [[InsertHint(j, -1, keys[j - 1] if j else None) for j in range(len(keys))]
                                   for keys in trace.requests]


def test_timestamps_of_the_json_formats(tmp_path: Path) -> None:
    assert read_trace(TINY).timestamps == [0.0, 0.01, 0.02, 0.03, 0.04, 0.05]  # Mooncake: ms
    path = tmp_path / "t.jsonl"
    path.write_text('{"blocks": [1], "timestamp": 12.5}\n{"blocks": [2], "timestamp": 14}\n')
    assert read_trace(path).timestamps == [0.0, 1.5]
    path.write_text('{"blocks": [1], "timestamp": 12.5}\n{"blocks": [2]}\n')
    assert read_trace(path).timestamps == []  # not every request has one: none
    assert read_trace(SLICE).duration_seconds is not None


def test_a_trace_without_prefix_information_says_so(tmp_path: Path) -> None:
    trace = read_trace(_csv(tmp_path, AZURE_ROWS))
    results = run_all(trace, plan_runs(["default"], [5, 20]), lambda n: None)
    assert all(r.block_hits == 0 and r.prefix_hit_ratio == 0 for r in results)
    note = trace_note(trace)
    assert note["format"] == "azure" and note["prefix_information"] is False
    assert note["duration_seconds"] == pytest.approx(4.541877) and "0 by construction" in note["note"]
    assert results_json(trace, results)["trace_note"] == note
    mooncake = trace_note(read_trace(TINY))
    assert mooncake["prefix_information"] is True and mooncake["note"] is None
    assert mooncake["duration_seconds"] == pytest.approx(0.05)
    # the default's gap to MIN: no gap to close, said as such (not a blank, not 0 %)
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(results_table(trace, results))
    assert console.export_text().count("n/a (no gap)") == 2


# --- memory: refused before it is spent ----------------------------------------------------------------

def _lengths_csv(tmp_path: Path, rows: int, tokens: int) -> Path:
    return _csv(tmp_path, "Timestamp,ContextTokens\n" + "".join(f"{i},{tokens}\n" for i in range(rows)))


def test_a_csv_trace_too_large_for_the_memory_is_refused_naming_the_limit_that_fits(tmp_path: Path) -> None:
    path = _lengths_csv(tmp_path, 1000, 1600)  # 100 blocks a request, 100,000 references, all distinct
    need = replay_memory(100_000, 100_000, 25_000)
    refused = r"azure\.csv: 100,000 block references \(100,000 distinct\) in 1,000 requests need about \d+ MB"
    with pytest.raises(TraceTooLargeError, match=refused + r".* --limit \d+$") as info:
        read_trace(path, memory_budget=need - 1)
    assert 0 < info.value.limit < 1000 and str(info.value).endswith(f"--limit {info.value.limit}")
    assert len(read_trace(path, memory_budget=need - 1, limit=info.value.limit).requests) == info.value.limit
    assert read_trace(path, memory_budget=need).references == 100_000


def test_a_jsonl_trace_stops_reading_where_it_outgrows_the_memory(tmp_path: Path) -> None:
    full = read_trace(SLICE)
    need = replay_memory(full.references, full.distinct_blocks, full.distinct_blocks // 4)
    budget = (need + replay_memory(0, 0, 0)) // 2
    with pytest.raises(TraceTooLargeError, match=r"mooncake_slice\.jsonl: more than [\d,]+ block references "
                                                r"\([\d,]+ distinct\) in the first [\d,]+ requests") as info:
        read_trace(SLICE, memory_budget=budget)
    assert 0 < info.value.limit < len(full.requests)
    assert read_trace(SLICE, memory_budget=budget, limit=info.value.limit).requests == \
        full.requests[:info.value.limit]
    with pytest.raises(ValueError, match="memory_budget must be positive"):
        read_trace(SLICE, memory_budget=0)


def test_replay_command_refuses_a_trace_or_capacity_too_large_for_the_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import kvtier.cli_replay

    path = _lengths_csv(tmp_path, 1000, 1600)
    budget = replay_memory(100_000, 100_000, 25_000)  # the reader's check passes; 100 % resident does not
    monkeypatch.setattr(kvtier.cli_replay, "available_memory", lambda: budget)
    assert main(["replay", str(path), "--capacity", "100%", "--no-progress", "--json"]) == 2
    err = capsys.readouterr().err
    assert "trace too large" in err and "--limit" in err and "smaller capacities" in err
    monkeypatch.setattr(kvtier.cli_replay, "available_memory", lambda: budget // 2)
    assert main(["replay", str(path), "--no-progress", "--json"]) == 2
    assert "trace too large" in capsys.readouterr().err
    assert main(["replay", str(path), "--no-progress", "--json", "--no-memory-check", "--policy", "lru",
                 "--capacity", "100%", "--no-min"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["block_references"] == 100_000
    import kvtier.hostinfo  # the demo's trace table checks the same way

    monkeypatch.setattr(kvtier.hostinfo, "available_memory", lambda: budget // 2)
    assert main(["demo", "--trace", str(path)]) == 2
    assert "trace too large" in capsys.readouterr().out
