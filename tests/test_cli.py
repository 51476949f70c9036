"""The `kvtier` command, run as a user runs it."""

from __future__ import annotations

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


@pytest.mark.parametrize("command", ["demo", "check", "stats", "replay"])
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: kvtier" in capsys.readouterr().out
