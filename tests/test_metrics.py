"""Stats, Prometheus exposition and `kvtier stats`, through a real cache and a real HTTP endpoint."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvtier import TieredCache
from kvtier.cli import main
from tests.helpers import make_keys, random_blocks, small_layout


def samples(text: str, name: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels.get("tier", "") + "/" + sample.labels.get("op", "")] = sample.value
    return out


def test_prometheus_endpoint_serves_per_tier_metrics(two_tier_config: dict[str, Any],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    layout = small_layout()
    two_tier_config["metrics"] = {"port": 0}
    keys, blocks = make_keys(8), random_blocks(8, layout)
    with TieredCache.from_config(two_tier_config) as cache:
        for i in range(8):
            cache.store(keys[i:i + 1], blocks[i:i + 1])
        assert cache.load(keys, torch.empty_like(blocks)) == 8
        assert cache.metrics_server is not None
        url = cache.metrics_server.url
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        hits = samples(text, "kvtier_tier_hits_total")
        assert hits == {"cpu/": 4.0, "file/": 4.0}
        assert samples(text, "kvtier_tier_misses_total") == {"cpu/": 4.0, "file/": 0.0}
        assert samples(text, "kvtier_tier_evictions_total")["cpu/"] == 8.0
        assert samples(text, "kvtier_tier_op_seconds_count")["file/get"] == 1.0
        assert samples(text, "kvtier_tier_usage_bytes")["cpu/"] == 4 * layout.nbytes

        assert main(["stats", "--url", url, "--json"]) == 0
        rows = {r["tier"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows["file"]["hits"] == 4 and rows["cpu"]["evictions"] == 8


def test_stats_of_a_file_tier_directory(two_tier_config: dict[str, Any],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    layout = small_layout()
    two_tier_config["placement"] = {"write_mode": "write_through"}
    with TieredCache.from_config(two_tier_config) as cache:
        cache.store(make_keys(3), random_blocks(3, layout))
    assert main(["stats", "--dir", two_tier_config["tiers"][1]["path"], "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["blocks"] == 3 and row["group"] == "0" and row["bytes on disk"] >= 3 * layout.nbytes


def test_stats_reports_an_unreachable_endpoint(tmp_path: Path) -> None:
    assert main(["stats", "--url", "http://127.0.0.1:9/metrics"]) == 1
    assert main(["stats", "--dir", str(tmp_path / "missing")]) == 1


def test_latency_histograms_in_the_python_stats(two_tier_config: dict[str, Any]) -> None:
    with TieredCache.from_config(two_tier_config) as cache:
        cache.store(make_keys(2), random_blocks(2, small_layout()))
        cpu = cache.stats().tiers[0]
        assert cpu.latency["put"].count == 1 and sum(cpu.latency["put"].counts) == 1


def test_a_degraded_tier_logs_once_per_state_change(two_tier_config: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    import errno
    import logging
    import os

    layout = small_layout()
    two_tier_config["placement"] = {"write_mode": "write_through"}
    real_pwritev = os.pwritev

    def disk_full(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with TieredCache.from_config(two_tier_config) as cache, caplog.at_level(logging.WARNING, "kvtier.tiers"):
        monkeypatch.setattr(os, "pwritev", disk_full)
        for start in range(0, 12, 3):
            cache.store(make_keys(3, start=start), random_blocks(3, layout))
        assert cache.stats().tiers[1].health == "writes failing (enospc)"
        monkeypatch.setattr(os, "pwritev", real_pwritev)
        cache.store(make_keys(2, start=100), random_blocks(2, layout))
        assert cache.stats().tiers[1].health == "ok"
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.tiers"]
    assert len(lines) == 2 and "degraded" in lines[0] and "recovered" in lines[1]
