"""The `kvtier` command, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_demo_runs_end_to_end_and_verifies_every_block(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "demo", "--quiet", "--dir", str(tmp_path),
         "--conversations", "4", "--turns", "3", "--system-tokens", "256", "--turn-tokens", "64"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-exact" in proc.stdout
    assert "cpu (cpu)" in proc.stdout and "nvme (file)" in proc.stdout


def test_demo_on_a_user_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(f"""
model: {{name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 64}}
tiers:
  - {{type: cpu, capacity: 128KiB}}
  - {{type: file, path: {tmp_path / 'files'}, capacity: 4MiB}}
""")
    assert main(["demo", "--quiet", "--config", str(config), "--conversations", "3", "--turns", "3"]) == 0
    out = capsys.readouterr().out
    assert "bit-exact" in out
    assert "demoted" in out


def test_demo_shows_the_policy_table_and_plot_of_a_trace(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text("""
model: {name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 64}
tiers:
  - {type: cpu, capacity: 128KiB}
""")
    trace = REPO / "tests" / "fixtures" / "mooncake_slice.jsonl"
    assert main(["demo", "--quiet", "--config", str(config), "--conversations", "2", "--turns", "2",
                 "--trace", str(trace), "--plot-dir", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "leaf_lru" in out and "adaptive" in out and "belady" in out and "gap to min closed" in out
    assert (tmp_path / "plots" / "policies_mooncake_slice.png").stat().st_size > 10_000


def test_replay_of_an_azure_csv_says_its_ratios_are_zero_by_construction(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:15:{i:02d}.{i:07d},{100 * i + 7},3\n" for i in range(30)))
    assert main(["replay", str(trace), "--no-progress", "--capacity", "10%", "50%"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the note is wrapped to the terminal
    assert "note: every hit ratio here is 0 by construction" in out and "no prefix information" in out
    assert "30 requests over 29 s" in out and "n/a (no gap)" in out
    assert main(["replay", str(trace), "--no-progress", "--format", "azure", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    note = doc["trace_note"]
    assert note["format"] == "azure" and note["prefix_information"] is False
    assert note["duration_seconds"] == pytest.approx(29.0000029) and "0 by construction" in note["note"]
    assert doc["trace"]["format"] == "azure" and doc["trace"]["block_tokens"] == 16
    assert all(r["block_hit_ratio"] == 0 == r["prefix_hit_ratio"] for r in doc["results"])
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,contexttokens\n2023-11-16 18:15:00,-4\n")
    assert main(["replay", str(bad), "--no-progress"]) == 2
    assert f"{bad}:2: column contexttokens:" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("**/*.yaml")), ids=lambda p: p.name)
def test_every_example_config_checks(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(example)]) == 0, capsys.readouterr().out


def test_check_names_the_bad_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: m, num_layers: 2, num_kv_heads: 2, head_dim: 8}\n"
                   "tiers: [{type: cpu, capacity: 1GiB, evction: lru}]\n")
    assert main(["check", str(bad)]) == 2
    assert "tiers[0].evction" in capsys.readouterr().out


def test_check_never_prints_a_redis_password(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "redis.yaml"
    cfg.write_text("model: {name: m, num_layers: 2, num_kv_heads: 2, head_dim: 8}\n"
                   "tiers:\n  - {type: cpu, capacity: 1GiB}\n"
                   "  - {type: redis, url: 'redis://kv:s3cret@127.0.0.1:6379/0', password: hunter2}\n")
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "hunter2" not in out


def test_check_says_which_client_moves_redis_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The native client where it can run; otherwise the Python client and the reason."""
    from rich.console import Console

    import kvtier.cli
    from kvtier.kernels import host

    monkeypatch.setattr(kvtier.cli, "console", Console(width=250))  # one line per table row

    cfg = tmp_path / "redis.yaml"
    cfg.write_text("model: {name: m, num_layers: 2, num_kv_heads: 2, head_dim: 8}\n"
                   "tiers:\n  - {type: cpu, capacity: 1GiB}\n"
                   "  - {name: r1, type: redis, url: 'redis://127.0.0.1:6379/0'}\n"
                   "  - {name: r2, type: redis, url: 'redis://127.0.0.1:6380/0', compression: lz4}\n"
                   "  - {name: r3, type: redis, url: 'rediss://127.0.0.1:6381/0'}\n")
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    first = "native client" if host.redis_available() else "Python client ("
    assert first in out
    assert "Python client (lz4 is encoded in Python)" in out
    assert "Python client (TLS)" in out


@pytest.mark.parametrize("command", ["demo", "check", "stats", "replay"])
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: kvtier" in capsys.readouterr().out
