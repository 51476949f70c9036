from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.config import GpuTierConfig, build_spec, load_config, parse_size
from kvtier.errors import KVTierConfigError
from tests.helpers import SMALL_MODEL


def base(tmp_path: Path) -> dict[str, Any]:
    return {"model": dict(SMALL_MODEL),
            "tiers": [{"type": "cpu", "capacity": "64MiB"},
                      {"type": "file", "path": str(tmp_path), "capacity": "1GiB"}]}


def error_for(cfg: Any) -> str:
    with pytest.raises(KVTierConfigError) as info:
        load_config(cfg)
    return str(info.value)


def test_sizes_parse_with_units() -> None:
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("512 MB") == 512 * 10**6
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError, match="units"):
        parse_size("8 parsecs")


def test_valid_config_loads_from_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"""
model: {{name: m, num_layers: 32, num_kv_heads: 8, head_dim: 128, dtype: bf16}}
hash_block_size: 16
block_size: 64
groups: [{{block_size: 16}}]
tiers:
  - {{type: cpu, capacity: 8GiB, eviction: lru}}
  - {{type: file, path: {tmp_path}, capacity: 100GiB, compression: lz4}}
placement: {{write_mode: write_through, promote_on_hit: false}}
""")
    cfg = load_config(path)
    spec = build_spec(cfg)
    assert spec.block_size_factor == 4
    assert spec.groups[0].layout.block_size == 64
    assert spec.groups[0].layout.nbytes == 32 * 2 * 64 * 8 * 128 * 2
    assert cfg.tiers[0].capacity == 8 << 30


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda c: c["tiers"][1].update(capacity="lots"), "tiers[1].capacity"),
    (lambda c: c["tiers"][0].update(eviction="random"), "tiers[0].eviction"),
    (lambda c: c["tiers"][1].update(compresion="lz4"), "tiers[1].compresion"),
    (lambda c: c["model"].update(num_layers=0), "model.num_layers"),
    (lambda c: c["model"].update(dtype="float64"), "model.dtype"),
    (lambda c: c["tiers"].append({"type": "tape", "capacity": 1}), "tiers[2]"),
    (lambda c: c["tiers"].append({"type": "redis"}), "tiers[2]"),
    (lambda c: c.update(placement={"promote_to": 5}), "promote_to"),
    (lambda c: c.update(groups=[{"block_size": 16}, {"block_size": 32}], block_size=64), "block_size"),
    (lambda c: c.update(groups=[{"block_size": 24}]), "groups[0].block_size"),
    (lambda c: c.pop("model"), "model"),
])
def test_errors_name_the_key_path(tmp_path: Path, mutate: Any, expected: str) -> None:
    cfg = base(tmp_path)
    mutate(cfg)
    assert expected in error_for(cfg)


def test_bad_value_is_shown(tmp_path: Path) -> None:
    cfg = base(tmp_path)
    cfg["tiers"][0]["capacity"] = "12 bananas"
    message = error_for(cfg)
    assert message.startswith("tiers[0].capacity:") and "12 bananas" in message


def test_unreadable_file_and_bad_yaml(tmp_path: Path) -> None:
    assert "cannot read" in error_for(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    assert "invalid YAML" in error_for(bad)
    assert "<root>" in error_for("- just\n- a list\n")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA message")
def test_gpu_tier_without_cuda_names_the_tier(tmp_path: Path) -> None:
    from kvtier import TieredCache

    cfg = base(tmp_path)
    cfg["tiers"].insert(0, {"type": "gpu", "capacity": "1GiB", "device": 0})
    load_config(cfg)  # the schema is valid anywhere
    with pytest.raises(KVTierConfigError, match=r"tiers\[0\].*CUDA is unavailable"):
        TieredCache.from_config(cfg)


def gpu_config(tmp_path: Path, **transfer: Any) -> dict[str, Any]:
    cfg = base(tmp_path)
    cfg["tiers"].insert(0, {"type": "gpu", "capacity": "1GiB",
                            **({"transfer": transfer} if transfer else {})})
    return cfg


def test_gpu_transfer_defaults_to_auto_at_the_built_in_crossover(tmp_path: Path) -> None:
    from kvtier.tiers.gpu import DEFAULT_CROSSOVER_BYTES, TransferChoice

    tier = load_config(gpu_config(tmp_path)).tiers[0]
    assert isinstance(tier, GpuTierConfig)
    transfer = tier.transfer
    assert (transfer.method, transfer.crossover) == ("auto", DEFAULT_CROSSOVER_BYTES)
    assert TransferChoice() == TransferChoice(transfer.method, transfer.crossover)


def test_gpu_transfer_keys_parse_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"""
model: {{name: m, num_layers: 2, num_kv_heads: 2, head_dim: 8}}
tiers:
  - {{type: gpu, capacity: 1GiB, transfer: {{method: copy_engine, crossover: 256KiB}}}}
  - {{type: file, path: {tmp_path}, capacity: 1GiB}}
""")
    tier = load_config(path).tiers[0]
    assert isinstance(tier, GpuTierConfig)
    assert (tier.transfer.method, tier.transfer.crossover) == ("copy_engine", 256 << 10)


@pytest.mark.parametrize(("transfer", "expected"), [
    ({"method": "dma"},
     "tiers[0].transfer.method: Input should be 'auto', 'kernel' or 'copy_engine' (got 'dma')"),
    ({"crossover": "12 bananas"}, "tiers[0].transfer.crossover: Value error, expected a size like '8GiB'"),
    ({"crossover": -1}, "tiers[0].transfer.crossover: Value error, size must not be negative"),
    ({"crosover": "64KiB"}, "tiers[0].transfer.crosover: Extra inputs are not permitted"),
    ("kernel", "tiers[0].transfer: Input should be a valid dictionary"),
])
def test_gpu_transfer_errors_name_the_key_path(tmp_path: Path, transfer: Any, expected: str) -> None:
    cfg = gpu_config(tmp_path)
    cfg["tiers"][0]["transfer"] = transfer
    assert error_for(cfg).startswith(expected)


def test_transfer_is_a_gpu_tier_key(tmp_path: Path) -> None:
    cfg = base(tmp_path)
    cfg["tiers"][0]["transfer"] = {"method": "kernel"}
    assert error_for(cfg).startswith("tiers[0].transfer: Extra inputs are not permitted")


def test_gpu_tier_is_built_with_its_transfer_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The YAML key reaches the tier (a CPU stand-in records what the builder passes, so no GPU is needed)."""
    import kvtier.tiers.gpu
    from kvtier.config import build_cache_parts
    from kvtier.tiers.cpu import CpuTier
    from kvtier.tiers.gpu import TransferChoice

    class RecordingTier(CpuTier):
        def __init__(self, name: str, layouts: Any, capacity_bytes: Any, *, device: int,
                     transfer: TransferChoice) -> None:
            super().__init__(name, layouts, capacity_bytes, pinned=False)
            self.device_index, self.transfer = device, transfer

    monkeypatch.setattr(kvtier.tiers.gpu, "GpuTier", RecordingTier)
    cfg = gpu_config(tmp_path, method="kernel", crossover="1MiB")
    cfg["tiers"][0].update(capacity="1MiB", device=1)
    _, tiers, _, _ = build_cache_parts(load_config(cfg))
    assert isinstance(tiers[0], RecordingTier) and tiers[0].device_index == 1
    assert tiers[0].transfer == TransferChoice("kernel", 1 << 20)


# --- configs that would store nothing, or somewhere else than meant (issue 13, item 7) ----------------------
@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda c: c["tiers"][0].update(capacity=0),
     "tiers[0].capacity: Value error, a tier of 0 bytes stores nothing"),
    (lambda c: c["tiers"][1].update(capacity="0 GiB"), "tiers[1].capacity: Value error, a tier of 0 bytes"),
    (lambda c: c["tiers"][0].update(capacity=0.5),
     "tiers[0].capacity: Value error, a size in bytes must be a whole"),
    (lambda c: c["tiers"][0].update(capacity="0.5"),
     "tiers[0].capacity: Value error, a size in bytes must be a whole"),
    (lambda c: c["tiers"][0].update(capacity="8KiB"), "tiers[0].capacity: 8192 bytes holds no block"),
    (lambda c: c["tiers"][1].update(capacity=16383), "tiers[1].capacity: 16383 bytes holds no block"),
    (lambda c: c.update(groups=[]), "groups: Value error, an empty list of KV-cache groups stores nothing"),
])
def test_a_config_that_stores_nothing_is_an_error_naming_the_key(tmp_path: Path, mutate: Any,
                                                                 expected: str) -> None:
    cfg = base(tmp_path)  # SMALL_MODEL: 16 KiB blocks
    mutate(cfg)
    assert error_for(cfg).startswith(expected)


def test_one_block_is_enough_and_fractions_of_a_unit_still_parse(tmp_path: Path) -> None:
    cfg = base(tmp_path)
    cfg["tiers"][0]["capacity"] = 16384
    cfg["tiers"][1]["capacity"] = "0.5MiB"
    loaded = load_config(cfg)
    assert (loaded.tiers[0].capacity, loaded.tiers[1].capacity) == (16384, 512 << 10)  # type: ignore[union-attr]


def test_every_group_must_fit_once(tmp_path: Path) -> None:
    cfg = base(tmp_path)
    cfg["groups"] = [{"block_size": 16}, {"block_size": 16, "name": "sliding", "num_layers": 1}]
    cfg["tiers"][0]["capacity"] = 16384 + 8192 - 1  # one block of group 0 fits, not one of each group
    message = error_for(cfg)
    assert message.startswith("tiers[0].capacity: 24575 bytes holds no block: "
                              "one block of every KV-cache group takes 24576 bytes")


def test_two_file_tiers_on_one_directory_is_an_error(tmp_path: Path) -> None:
    cfg = base(tmp_path)
    cfg["tiers"].append({"type": "file", "name": "again", "path": str(tmp_path / "x" / ".."),
                         "capacity": "1GiB"})
    assert error_for(cfg).startswith(f"tiers[2].path: '{tmp_path / 'x' / '..'}' "
                                     "is also the directory of tiers[1]")
    cfg["tiers"][2]["path"] = str(tmp_path / "other")
    load_config(cfg)


@pytest.mark.parametrize("reference", ["${KVTIER_TEST_UNSET}", "$KVTIER_TEST_UNSET"])
def test_an_unset_variable_in_a_file_path_is_an_error_and_makes_no_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: str) -> None:
    from kvtier import TieredCache

    monkeypatch.delenv("KVTIER_TEST_UNSET", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = base(tmp_path)
    cfg["tiers"][1]["path"] = f"{reference}/kvtier"
    assert error_for(cfg).startswith("tiers[1].path: Value error, "
                                     "environment variable KVTIER_TEST_UNSET is not set")
    with pytest.raises(KVTierConfigError):
        TieredCache.from_config(cfg)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("KVTIER_TEST_UNSET", str(tmp_path / "set"))
    loaded = load_config(cfg)
    assert loaded.tiers[1].path == str(tmp_path / "set" / "kvtier")  # type: ignore[union-attr]


def test_a_file_path_expands_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = base(tmp_path)
    cfg["tiers"][1]["path"] = "~/kvtier"
    assert load_config(cfg).tiers[1].path == str(tmp_path / "kvtier")  # type: ignore[union-attr]


# --- every problem, not only the first (item 8) -------------------------------------------------------------
def test_the_error_lists_every_problem_with_its_key_path(tmp_path: Path) -> None:
    cfg = base(tmp_path)
    cfg["tiers"][0]["capacity"] = "lots"
    cfg["tiers"][1]["evction"] = "lru"
    cfg["model"]["num_layers"] = 0
    with pytest.raises(KVTierConfigError) as info:
        load_config(cfg)
    assert str(info.value).endswith("[and 2 more errors]")
    problems = info.value.problems
    assert len(problems) == 3
    assert {p.split(":", 1)[0] for p in problems} == {"model.num_layers", "tiers[0].capacity",
                                                      "tiers[1].evction"}


def test_a_single_problem_is_its_own_list(tmp_path: Path) -> None:
    cfg = base(tmp_path)
    cfg["tiers"][0]["capacity"] = "lots"
    with pytest.raises(KVTierConfigError) as info:
        load_config(cfg)
    assert info.value.problems == (str(info.value),)


# --- optional dependencies (item 10) ------------------------------------------------------------------------
def test_a_redis_tier_without_the_redis_package_names_the_extra(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    cfg = base(tmp_path)
    cfg["tiers"].append({"type": "redis", "url": "redis://127.0.0.1:6379/0"})
    # what `import redis` sees when the package is not installed
    monkeypatch.setitem(sys.modules, "redis", None)
    message = error_for(cfg)
    assert message.startswith("tiers[2]: Value error, a redis tier needs the redis package, "
                              "which is not installed: pip install 'kvtier[redis]'")


# --- torch-free validation (item 11) ------------------------------------------------------------------------
@given(st.integers(1, 64), st.integers(1, 16), st.sampled_from([1, 64, 80, 128, 576]),
       st.sampled_from([1, 16, 64]),
       st.sampled_from(["float16", "bf16", "fp32", "fp8", "float8_e5m2", "int8", "uint8"]),
       st.sampled_from([1, 2]), st.sampled_from(["NHD", "HND"]))
def test_geometry_and_layout_agree_on_size_description_and_fingerprint(
        layers: int, heads: int, dim: int, tokens: int, dtype: str, kv: int, order: str) -> None:
    from kvtier.geometry import BlockGeometry, canonical_dtype
    from kvtier.layout import BlockLayout

    layout = BlockLayout(layers, heads, dim, tokens, dtype=dtype, kv_factor=kv, token_layout=order)  # type: ignore[arg-type]
    geometry = BlockGeometry(layers, heads, dim, tokens, dtype=dtype, kv_factor=kv, token_layout=order)
    assert layout.geometry == BlockGeometry(layers, heads, dim, tokens, canonical_dtype(dtype), kv, order)
    assert (geometry.nbytes, geometry.describe(), geometry.fingerprint()) == \
        (layout.nbytes, layout.describe(), layout.fingerprint())


def test_the_torch_free_namespace_is_the_cache_namespace(tmp_path: Path) -> None:
    from kvtier.config import build_namespace, namespace_for, plan_groups

    cfg = base(tmp_path)
    cfg["groups"] = [{"block_size": 16}, {"block_size": 32, "name": "sliding", "num_layers": 1}]
    loaded = load_config(cfg)
    _, plans = plan_groups(loaded)
    assert namespace_for(loaded, [(p.group_id, p.geometry) for p in plans]) == build_namespace(
        loaded, build_spec(loaded))


def test_the_layout_fingerprint_did_not_change() -> None:
    """Stored blocks carry it: a new value would turn every existing file and Redis value into a miss."""
    from kvtier.layout import BlockLayout

    layout = BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")  # type: ignore[arg-type]
    assert layout.describe() == "cross_layer[L=32,kv=2,tokens=16,heads=8,dim=128] bfloat16 NHD"
    assert layout.fingerprint() == __import__("xxhash").xxh3_64_intdigest(layout.describe().encode())


def redis_config(tmp_path: Path, **redis: Any) -> dict[str, Any]:
    cfg = base(tmp_path)
    cfg["tiers"].append({"type": "redis", "url": "redis://127.0.0.1:6379/0", **redis})
    return cfg


@pytest.mark.parametrize(("redis", "expected"), [
    ({"url": "http://localhost"}, "tiers[2].url: Value error, expected redis://"),
    ({"url": "redis://127.0.0.1:port/0"}, "tiers[2].url: Value error, expected redis://"),
    ({"cluster": True, "url": "redis://127.0.0.1:7000/3"},
     "tiers[2]: Value error, a Redis Cluster has only database 0"),
    ({"cluster": True, "startup_nodes": ["127.0.0.1:7000", "nohost"]},
     "tiers[2].startup_nodes[1]: Value error, expected host:port (got 'nohost')"),
    ({"cluster": True, "startup_nodes": []}, "tiers[2].startup_nodes: List should have at least 1 item"),
    ({"startup_nodes": ["127.0.0.1:7000"]},
     "tiers[2]: Value error, startup_nodes is given but cluster is false"),
    ({"compression": "zstd"}, "tiers[2].compression: Input should be 'none' or 'lz4'"),
    ({"ttl_seconds": 0}, "tiers[2].ttl_seconds: Input should be greater than 0"),
    ({"ttl_seconds": True}, "tiers[2].ttl_seconds: Input should be a valid number"),
    ({"timeout": 0}, "tiers[2].timeout: Input should be greater than 0"),
    ({"max_connections": 0}, "tiers[2].max_connections: Input should be greater than 0"),
    ({"circuit_breaker": {"failure": 3}}, "tiers[2].circuit_breaker.failure: Extra inputs are not permitted"),
    ({"circuit_breaker": {"failures": 0}},
     "tiers[2].circuit_breaker.failures: Input should be greater than 0"),
    ({"circuit_breaker": {"failures": True}},
     "tiers[2].circuit_breaker.failures: Input should be a valid integer"),
    ({"circuit_breaker": {"failures": 2.5}},
     "tiers[2].circuit_breaker.failures: Input should be a valid integer"),
    ({"circuit_breaker": {"cooldown_seconds": -1}},
     "tiers[2].circuit_breaker.cooldown_seconds: Input should be greater than or equal to 0"),
])
def test_redis_errors_name_the_key_path(tmp_path: Path, redis: dict[str, Any], expected: str) -> None:
    assert error_for(redis_config(tmp_path, **redis)).startswith(expected)


def test_redis_settings_reach_the_tier_as_validated(tmp_path: Path) -> None:
    """One validation path: the tier gets the config's values, breaker model included, unchanged."""
    from kvtier.config import build_cache_parts
    from kvtier.tiers.redis import CircuitBreakerConfig, RedisTier

    cfg = load_config(redis_config(tmp_path, url="rediss://user:p%40ss@example.org:7001/2", ttl_seconds=1.5,
                                   circuit_breaker={"failures": 2, "cooldown_seconds": 0}, max_connections=3))
    _, tiers, _, _ = build_cache_parts(cfg)
    tier = tiers[2]
    assert isinstance(tier, RedisTier)
    assert (tier.tls, tier.username, tier.password, tier.db, str(tier.address)) == (
        True, "user", "p@ss", 2, "example.org:7001")
    assert (tier.ttl_seconds, tier.max_connections) == (1.5, 3)
    assert tier.breaker_config == CircuitBreakerConfig(failures=2, cooldown_seconds=0)
    assert tier.breaker_config is cfg.tiers[2].circuit_breaker  # type: ignore[union-attr]

    cluster = load_config(redis_config(tmp_path, url=None, cluster=True,
                                       startup_nodes=["[::1]:7000", "10.0.0.2:7001"]))
    _, tiers, _, _ = build_cache_parts(cluster)
    assert isinstance(tiers[2], RedisTier) and tiers[2].cluster
    assert [str(a) for a in tiers[2].startup_nodes] == ["::1:7000", "10.0.0.2:7001"]


def test_redis_tier_without_redis_py_is_a_config_error(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The config (and a cache without a redis tier) needs no redis-py; building a redis tier names the
    extra."""
    import sys

    from kvtier.config import build_cache_parts

    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` now raises ImportError
    build_cache_parts(load_config(base(tmp_path)))
    with pytest.raises(KVTierConfigError, match=r"^tiers\[2\]: .*pip install 'kvtier\[redis\]'"):
        build_cache_parts(load_config(redis_config(tmp_path)))


@pytest.mark.parametrize(("keys", "mode"), [({}, "synced"), ({"write_io": "direct"}, "direct"),
                                            ({"write_io": "buffered"}, "buffered"),
                                            ({"direct_io": False}, "buffered"),
                                            ({"direct_io": True}, "direct"),
                                            ({"direct_io": False, "write_io": "synced"}, "synced")])
def test_the_file_tier_write_io_key_and_its_older_direct_io_form(tmp_path: Path, keys: dict[str, Any],
                                                                 mode: str) -> None:
    import asyncio

    from kvtier.config import build_cache_parts

    cfg = base(tmp_path)
    cfg["tiers"][1].update(keys)
    loaded = load_config(cfg)
    assert loaded.tiers[1].write_io == keys.get("write_io")  # type: ignore[union-attr]
    _, tiers, _, _ = build_cache_parts(loaded)
    try:
        assert tiers[1].kind == "file" and tiers[1].write_io_active == mode  # type: ignore[attr-defined]
    finally:
        for tier in tiers:
            asyncio.run(tier.close())


def test_a_bad_or_contradicting_file_write_io_names_the_key(tmp_path: Path) -> None:
    cfg = base(tmp_path)
    cfg["tiers"][1]["write_io"] = "fast"
    assert error_for(cfg).startswith("tiers[1].write_io: Input should be 'direct', 'synced' or 'buffered'")
    cfg["tiers"][1].update(write_io="synced", direct_io=True)
    assert error_for(cfg).startswith("tiers[1].write_io: Value error, write_io: synced contradicts "
                                     "direct_io: true")
    cfg["tiers"][1].update(write_io="direct", direct_io=False)
    assert "write_io: direct contradicts direct_io: false" in error_for(cfg)


def test_cpu_copy_threads_reach_the_tier_and_a_bad_count_names_the_key(tmp_path: Path) -> None:
    cfg = base(tmp_path)
    for bad in (0, 65, True, "many"):
        cfg["tiers"][0]["copy_threads"] = bad
        assert error_for(cfg).startswith("tiers[0].copy_threads")
    cfg["tiers"][0]["copy_threads"] = 3
    from kvtier.config import build_cache_parts

    _, tiers, _, _ = build_cache_parts(load_config(cfg))
    try:
        assert tiers[0].copier.threads == 3  # type: ignore[attr-defined]
    finally:
        for tier in tiers:
            asyncio.run(tier.close())
    assert tiers[0].copier.threads == 1  # type: ignore[attr-defined]  # closed: its threads are gone
