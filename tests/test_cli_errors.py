"""The `kvtier` command on bad input and on a lean machine: one clear line, never a traceback or lost text.

Optional packages are made to look uninstalled in a subprocess (an import hook refusing them), and the
torch-free start of ``--help`` and ``check`` is checked in a fresh interpreter.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = "model: {name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 64}\n"  # 16 KiB blocks

#: Run in a fresh interpreter: refuse the imports of BLOCKED as if those packages were not installed, run
#: the command, then report whether torch was imported.
_RUNNER = """
import sys
BLOCKED = set(sys.argv[1].split(",")) - {""}
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
from kvtier.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as exc:
    code = exc.code
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def run_kvtier(*args: str, blocked: tuple[str, ...] = (),
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", _RUNNER, ",".join(blocked), *args], capture_output=True,
                          text=True, timeout=180, env=env, cwd=cwd or REPO)


def write_config(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- item 8: text is text, and every problem is printed -----------------------------------------------------
def test_brackets_in_paths_and_values_are_printed_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path / "conf[red]" / "kvtier.yaml",
                 TINY_MODEL + "tiers:\n  - {type: cpu, name: '[bold]ram', capacity: 1MiB}\n"
                              "  - {type: file, path: '[red]files', capacity: 1MiB}\n")
    assert main(["check", "conf[red]/kvtier.yaml"]) == 0
    out = capsys.readouterr().out
    assert "ok conf[red]/kvtier.yaml" in out
    assert "[red]files" in out and "[bold]ram" in out


def test_a_trace_name_with_brackets_is_printed_as_written(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    trace = tmp_path / "[red]tiny.jsonl"
    shutil.copy(REPO / "tests" / "fixtures" / "mooncake_tiny.jsonl", trace)
    assert main(["replay", str(trace), "--capacity", "10", "--no-min", "--no-progress"]) == 0
    assert "[red]tiny" in capsys.readouterr().out


def test_check_prints_every_problem_with_its_key_path(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "bad.yaml",
                       "model: {name: m, num_layers: 0, num_kv_heads: 2, head_dim: 8}\n"
                       "tiers:\n  - {type: cpu, capacity: '[red]lots'}\n"
                       "  - {type: file, path: /tmp/x, capacity: 1GiB, evction: lru}\n")
    assert main(["check", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "3 problems" in out
    lines = [line.strip() for line in out.splitlines()]
    assert any(line.startswith("model.num_layers: Input should be greater than 0") for line in lines)
    assert any(line.startswith("tiers[0].capacity: Value error, expected a size") and "'[red]lots'" in line
               for line in lines)
    assert any(line.startswith("tiers[1].evction: Extra inputs are not permitted") for line in lines)


# --- item 7 through the command -----------------------------------------------------------------------------
@pytest.mark.parametrize(("tiers", "expected"), [
    ("  - {type: cpu, capacity: 0}\n", "tiers[0].capacity: Value error, a tier of 0 bytes stores nothing"),
    ("  - {type: cpu, capacity: 0.5}\n",
     "tiers[0].capacity: Value error, a size in bytes must be a whole number"),
    ("  - {type: cpu, capacity: 1KiB}\n", "tiers[0].capacity: 1024 bytes holds no block"),
    ("  - {type: file, path: '${KVTIER_TEST_UNSET}/x', capacity: 1GiB}\n",
     "tiers[0].path: Value error, environment variable KVTIER_TEST_UNSET is not set"),
    ("  - {type: file, path: /tmp/kvtier-same, capacity: 1GiB}\n"
     "  - {type: file, name: again, path: /tmp/kvtier-same/, capacity: 1GiB}\n",
     "tiers[1].path: '/tmp/kvtier-same/' is also the directory of tiers[0]"),
])
def test_check_refuses_a_config_that_stores_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    tiers: str, expected: str) -> None:
    cfg = write_config(tmp_path / "k.yaml", TINY_MODEL + "tiers:\n" + tiers)
    assert main(["check", str(cfg)]) == 2
    assert expected in capsys.readouterr().out


def test_check_refuses_an_empty_group_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "k.yaml", TINY_MODEL + "groups: []\ntiers: [{type: cpu, capacity: 1GiB}]\n")
    assert main(["check", str(cfg)]) == 2
    assert "groups: Value error, an empty list of KV-cache groups stores nothing" in capsys.readouterr().out


# --- item 6 (check side): capacities this machine cannot hold -----------------------------------------------
def test_check_warns_when_a_capacity_exceeds_free_disk_or_memory(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "big.yaml",
                       TINY_MODEL + f"tiers:\n  - {{type: cpu, capacity: 900TiB}}\n"
                                    f"  - {{type: file, path: {tmp_path / 'a'}, capacity: 500TiB}}\n"
                                    f"  - {{type: file, name: b, path: {tmp_path / 'b'}, "
                                    f"capacity: 500TiB}}\n")
    # a warning, not an error: the disk may grow, other tiers may shrink
    assert main(["check", str(cfg)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "warning tiers[0].capacity: 900.00 TiB is more than the" in out
    assert "of memory available now" in out
    assert "warning tiers[1].capacity, tiers[2].capacity: 1000.00 TiB is more than the" in out
    assert "free on the filesystem of" in out


def test_check_is_quiet_about_capacities_that_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "small.yaml",
                       TINY_MODEL + f"tiers:\n  - {{type: cpu, capacity: 1MiB}}\n"
                                    f"  - {{type: file, path: {tmp_path / 'f'}, capacity: 1MiB}}\n")
    assert main(["check", str(cfg)]) == 0
    assert "warning" not in capsys.readouterr().out


def test_blocks_already_on_disk_count_as_room(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import capacity_warnings
    from kvtier.config import load_config
    from kvtier.hostinfo import free_disk

    (tmp_path / "ns" / "g0").mkdir(parents=True)
    (tmp_path / "ns" / "g0" / "blocks").write_bytes(os.urandom(256 << 20))  # the tier's own blocks
    try:
        # Over the free space by 128 MiB, under free space + the tier's 256 MiB by as much: margins wide
        # enough that other writers on a shared disk do not flip the answer between the two calls.
        capacity = free_disk(tmp_path)[1] + (128 << 20)
        cfg = load_config(TINY_MODEL + f"tiers: [{{type: file, path: {tmp_path}, capacity: {capacity}}}]\n")
        assert capacity_warnings(cfg, "ns") == []  # that space is the tier's own
        over = load_config(TINY_MODEL + f"tiers: [{{type: file, path: {tmp_path}, "
                                        f"capacity: {capacity + (512 << 20)}}}]\n")
        assert len(capacity_warnings(over, "ns")) == 1  # but not twice as much again
    finally:
        (tmp_path / "ns" / "g0" / "blocks").unlink()


# --- item 9: demo, replay --plot, stats ---------------------------------------------------------------------
@pytest.mark.parametrize(("args", "expected"), [
    (["--conversations", "0"], "argument --conversations: must be at least 1, got 0"),
    (["--conversations", "-3"], "argument --conversations: must be at least 1, got -3"),
    (["--turns", "0"], "argument --turns: must be at least 1, got 0"),
    (["--turn-tokens", "0"], "argument --turn-tokens: must be at least 1, got 0"),
    (["--system-tokens", "-1"], "argument --system-tokens: must not be negative, got -1"),
    (["--conversations", "many"], "argument --conversations: expected a whole number, got 'many'"),
])
def test_demo_refuses_bad_numbers_in_one_line(args: list[str], expected: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--quiet", *args])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"kvtier demo: error: {expected}"


def test_demo_refuses_a_file_as_its_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--quiet", "--dir", str(tmp_path / "a-file")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"kvtier demo: error: argument --dir: {tmp_path / 'a-file'} exists and is not a directory"


def test_demo_config_with_dir_puts_each_file_tier_under_dir(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "tiny.yaml",
                          TINY_MODEL + f"tiers:\n  - {{type: cpu, capacity: 64KiB}}\n"
                                       f"  - {{type: file, name: nvme, path: {tmp_path / 'production'}, "
                                       f"capacity: 4MiB}}\n")
    assert main(["demo", "--quiet", "--config", str(config), "--dir", str(tmp_path / "trial"),
                 "--conversations", "3", "--turns", "3"]) == 0
    out = capsys.readouterr().out
    assert "bit-exact" in out and f"at {tmp_path / 'trial' / 'nvme'}" in out
    assert not (tmp_path / "production").exists()
    assert list((tmp_path / "trial" / "nvme").rglob("*.kvb"))


def test_demo_dir_with_a_config_without_a_file_tier_is_refused(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "cpu.yaml", TINY_MODEL + "tiers: [{type: cpu, capacity: 1MiB}]\n")
    assert main(["demo", "--quiet", "--config", str(config), "--dir", str(tmp_path / "d")]) == 2
    assert "--dir: the config has no file tier to put there" in capsys.readouterr().out
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(("plot", "expected"), [
    ("hits.xyz", "'{d}/hits.xyz': .xyz is not a format matplotlib writes; use .png, .svg or .pdf"),
    ("hits", "'{d}/hits': no file extension; use .png, .svg or .pdf"),
    ("a-file/hits.png", "cannot write '{d}/a-file/hits.png': '{d}/a-file' is not a directory"),
    (".", "'{d}' is a directory; give a file name such as '{d}/replay.png'"),
])
def test_replay_checks_the_plot_target_before_replaying(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        plot: str, expected: str) -> None:
    (tmp_path / "a-file").write_text("")
    # the trace does not exist: a plot checked only after the replay would report the trace instead
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--plot", f"{tmp_path}/{plot}",
                 "--no-progress"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--plot {expected.format(d=tmp_path)}" in err
    assert "bad trace" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_replay_refuses_a_plot_in_a_folder_it_cannot_write(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--plot", str(locked / "p.png")]) == 2
    assert "no write permission" in capsys.readouterr().err


def test_stats_dir_finds_the_file_tier_under_a_demo_directory(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier import TieredCache
    from tests.helpers import make_keys, random_blocks, small_layout

    tier_path = tmp_path / "kvtier-files"  # where `kvtier demo --dir` puts its file tier
    cfg = TINY_MODEL + f"tiers: [{{type: file, path: {tier_path}, capacity: 1MiB}}]\n"
    with TieredCache.from_config(cfg) as cache:
        assert cache.store(make_keys(3), random_blocks(3, small_layout())) == 3
        namespace = cache.core.namespace.id  # type: ignore[union-attr]
    assert main(["stats", "--dir", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["path"], r["namespace"], r["group"], r["blocks"]) for r in rows] == \
        [("kvtier-files", namespace, "0", 3)]
    assert main(["stats", "--dir", str(tier_path), "--json"]) == 0  # the tier's own path: no path column
    assert json.loads(capsys.readouterr().out) == [{k: v for k, v in rows[0].items() if k != "path"}]


def test_stats_dir_without_a_tier_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "unrelated" / "stuff").mkdir(parents=True)
    assert main(["stats", "--dir", str(tmp_path)]) == 0
    assert f"no file-tier blocks under {tmp_path}" in capsys.readouterr().out


@pytest.mark.parametrize("url", ["127.0.0.1:9400/metrics", "localhost:9400", "file:///etc/passwd", "http://"])
def test_stats_url_without_http_is_a_one_line_usage_error(url: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--url", url]) == 2
    out = capsys.readouterr().out.strip()
    assert out == f"--url expected a metrics endpoint like http://127.0.0.1:9400/metrics, got {url!r}"


@pytest.fixture
def web_server(tmp_path: Path) -> Iterator[str]:
    """A plain HTTP server on loopback: ``/`` is an HTML page, ``/other`` Prometheus text of another
    program."""
    (tmp_path / "index.html").write_text("<html><body><h1>Not metrics</h1></body></html>")
    (tmp_path / "other").write_text("# TYPE http_requests_total counter\nhttp_requests_total 7\n")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(tmp_path), **kwargs)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("path", "expected"), [
    ("/", "is not a Prometheus metrics endpoint"),
    ("/other", "no kvtier metrics at"),
])
def test_stats_url_that_serves_no_kvtier_metrics_is_a_one_line_error(
        web_server: str, path: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--url", web_server + path]) == 1
    out = capsys.readouterr().out.strip()
    assert expected in out and len(out.splitlines()) == 1


# --- item 10: optional packages -----------------------------------------------------------------------------
def test_check_names_the_redis_extra_when_redis_is_not_installed(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "r.yaml", TINY_MODEL + "tiers:\n  - {type: cpu, capacity: 1MiB}\n"
                                                         "  - {type: redis, url: 'redis://127.0.0.1:6379/0'}\n")
    proc = run_kvtier("check", str(cfg), blocked=("redis",))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "tiers[1]: Value error, a redis tier needs the redis package, which is not installed: " \
           "pip install 'kvtier[redis]'" in " ".join(proc.stdout.split())
    assert "Traceback" not in proc.stderr


def test_building_a_redis_tier_without_redis_names_the_extra(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed when the config was loaded, gone when the tier is built: still the extra, keyed by the
    tier."""
    from kvtier import KVTierConfigError, TieredCache, load_config

    cfg = load_config(TINY_MODEL + "tiers: [{type: cpu, capacity: 1MiB}, {type: redis, url: 'redis://127.0.0.1:1/0'}]\n")
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(KVTierConfigError, match=r"^tiers\[1\]\.type: .*pip install 'kvtier\[redis\]'"):
        TieredCache.from_config(cfg)


def test_a_plot_without_matplotlib_names_the_extra_before_the_replay(tmp_path: Path) -> None:
    proc = run_kvtier("replay", str(tmp_path / "missing.jsonl"), "--plot", str(tmp_path / "p.png"),
                      blocked=("matplotlib",))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--plot a plot needs the matplotlib package, which is not installed: " \
        "pip install 'kvtier[plot]'" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr and "bad trace" not in proc.stderr


# --- item 11: --version, python -m kvtier, no torch for --help and check ------------------------------------
def test_version_and_python_dash_m(capsys: pytest.CaptureFixture[str]) -> None:
    import kvtier

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvtier {kvtier.__version__}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "kvtier", "--version"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"kvtier {kvtier.__version__}")


@pytest.mark.parametrize("args", [["--help"], ["check", "--help"], ["check", "EXAMPLE"],
                                  ["check", "--vllm", "TIERS"], ["check", "MISSING"]])
def test_help_and_check_do_not_import_torch(tmp_path: Path, args: list[str]) -> None:
    tiers = write_config(tmp_path / "tiers.yaml", "tiers: [{type: cpu, capacity: 1GiB}]\n")
    where = {"EXAMPLE": str(REPO / "examples" / "cpu_file.yaml"), "TIERS": str(tiers),
             "MISSING": str(tmp_path / "no.yaml")}
    proc = run_kvtier(*(where.get(a, a) for a in args))
    assert proc.returncode in (0, 2), proc.stdout + proc.stderr
    assert "torch imported: False" in proc.stderr, proc.stderr


def test_the_public_api_resolves_lazily() -> None:
    import kvtier

    for name in kvtier.__all__:
        assert getattr(kvtier, name).__name__ == name
    assert set(kvtier.__all__) <= set(dir(kvtier))
    with pytest.raises(AttributeError, match="no attribute 'TieredCach'"):
        kvtier.TieredCach  # type: ignore[attr-defined]  # noqa: B018


# --- item 12: a tiers-only config for vLLM; "pinned" only with CUDA -----------------------------------------
def test_check_vllm_accepts_a_tiers_only_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "vllm.yaml", f"tiers:\n  - {{type: cpu, capacity: 8GiB}}\n"
                                               f"  - {{type: file, path: {tmp_path / 'f'}, capacity: 1GiB}}\n"
                                               f"placement: {{write_mode: write_through}}\n")
    assert main(["check", str(cfg)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "model: Field required" in out and "kvtier check --vllm FILE" in out
    assert main(["check", "--vllm", str(cfg)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(for the vLLM connector)" in out and "from the vLLM engine at start-up" in out
    assert "placement: write_through" in out and "from the engine" in out
    assert "namespace" not in out  # it depends on the engine's layout: not known here
    named = write_config(tmp_path / "named.yaml", "model: {name: my-llama}\n" + cfg.read_text())
    assert main(["check", "--vllm", str(named)]) == 0  # the connector takes the rest of `model` from vLLM
    capsys.readouterr()
    clash = write_config(tmp_path / "clash.yaml",
                         "model: {name: m, mla: true, num_kv_heads: 8}\n" + cfg.read_text())
    assert main(["check", "--vllm", str(clash)]) == 2
    assert "model.mla is true, so model.num_kv_heads must be 1" in capsys.readouterr().out


def test_check_vllm_still_refuses_bad_tiers_and_warns_about_keys_the_engine_sets(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = write_config(tmp_path / "bad.yaml", "tiers: [{type: cpu, capacity: 0}]\n")
    assert main(["check", "--vllm", str(bad)]) == 2
    assert "tiers[0].capacity: Value error, a tier of 0 bytes stores nothing" in capsys.readouterr().out
    keys = write_config(tmp_path / "keys.yaml", "block_size: 64\ngroups: [{block_size: 16}]\n"
                                                "tiers: [{type: cpu, capacity: 1GiB}]\n")
    assert main(["check", "--vllm", str(keys)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "warning block_size: set by the vLLM engine; set block_size (or blocks_per_chunk) in " \
           "kv_connector_extra_config" in out
    assert "warning groups: set by the vLLM engine; the value here is replaced at start-up" in out


def test_check_says_pinned_only_where_cuda_is_present(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "cpu.yaml",
                       TINY_MODEL + "tiers:\n  - {type: cpu, capacity: 1MiB}\n"
                                    "  - {type: cpu, name: plain, capacity: 1MiB, pinned: false}\n")
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert out.count("pinned host memory") == (1 if torch.cuda.is_available() else 0)
    assert out.count("host memory") == 2


def test_the_torch_free_cuda_probe_agrees_with_torch() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = ("import sys; from kvtier.hostinfo import cuda_present; present = cuda_present(); "
            "assert 'torch' not in sys.modules; print(present)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(torch.cuda.is_available())
