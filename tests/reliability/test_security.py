"""Security of the file and Redis tiers.

File tier: directories 0700 and files 0600 whatever the umask; a cache directory that another user
could control (owned by someone else, itself a symbolic link, or reached through a symbolic link that
neither this user nor root owns) is refused with a config error naming the path; key-derived paths
never leave the cache directory (hypothesis).

Redis: a password, an ACL user and TLS come from the config or from the environment (``${NAME}``),
work against a real server, and are never printed — not by ``kvtier check``, not in config errors,
not in the config's repr, not in logs, not even when the server refuses them. Namespaces keep
tenants apart on a shared Redis, and an ACL key pattern per namespace enforces it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import BlockKey, KVTierConfigError, TieredCache, load_config
from kvtier.cli import main as kvtier_main
from kvtier.config import build_namespace, build_spec
from kvtier.errors import TierUnavailable
from kvtier.tiers.file import FileTier
from tests.reliability.conftest import (
    BLOCK,
    LAYOUT,
    Oracle,
    cache_config,
    expected_bytes,
    tier_stats,
    universe,
)

OTHER_UID = 65534  # nobody


# --- file tier ----------------------------------------------------------------------------------------------
def modes_under(root: Path) -> tuple[set[int], set[int]]:
    dirs, files = {stat.S_IMODE(root.stat().st_mode)}, set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirs |= {stat.S_IMODE(os.stat(os.path.join(dirpath, d)).st_mode) for d in dirnames}
        files |= {stat.S_IMODE(os.stat(os.path.join(dirpath, f)).st_mode) for f in filenames}
    return dirs, files


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_directories_are_0700_and_files_0600_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        with TieredCache.from_config(cache_config(file_dir=tmp_path / "cache", cpu_blocks=1)) as cache:
            keys = universe(6, tag="modes")
            assert cache.store(keys, torch.stack([expected_bytes(k) for k in keys]).view(LAYOUT.dtype)
                               .view(6, *LAYOUT.shape)) == 6
    finally:
        os.umask(old)
    dirs, files = modes_under(tmp_path / "cache")
    assert dirs == {0o700} and files == {0o600}, (oct(max(dirs)), sorted(map(oct, files)))


def _as_other_user(path: Path, monkeypatch: pytest.MonkeyPatch, *, link: bool = False) -> None:
    """Make ``path`` belong to someone else: chown when we are root, else pretend to be another uid."""
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=not link)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: os.stat(path, follow_symlinks=not link).st_uid + 1)


def file_tier(root: Path, namespace: str = "ns") -> FileTier:
    return FileTier("file", {0: LAYOUT}, {0: 16 * BLOCK}, root=root, namespace=namespace)


def test_a_cache_directory_owned_by_another_user_is_refused(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    _as_other_user(foreign, monkeypatch)
    with pytest.raises(KVTierConfigError, match=rf"^path: {foreign} is owned by uid \d+, not by this user"):
        file_tier(foreign)
    assert not (foreign / "ns").exists()  # refused before anything was created in it
    cfg = cache_config(file_dir=foreign)
    with pytest.raises(KVTierConfigError, match=rf"^tiers\[1\]\.path: {foreign} is owned by uid"):
        TieredCache.from_config(cfg)


def test_a_namespace_directory_owned_by_another_user_is_refused(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ns").mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("needs root to give the namespace directory away while keeping the root ours")
    os.chown(tmp_path / "ns", OTHER_UID, OTHER_UID)
    with pytest.raises(KVTierConfigError, match=rf"^path: {tmp_path / 'ns'} is owned by uid {OTHER_UID}"):
        file_tier(tmp_path)


def test_a_cache_directory_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(KVTierConfigError,
                       match=rf"^path: {tmp_path / 'link'} is a symbolic link \(to {real}\)"):
        file_tier(tmp_path / "link")
    (real / "ns-target").mkdir()
    (real / "ns").symlink_to(real / "ns-target")
    with pytest.raises(KVTierConfigError, match=r"ns is a symbolic link"):
        file_tier(real)


def test_a_path_through_another_users_symbolic_link_is_refused(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "real"
    (real / "cache").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    if os.geteuid() == 0:
        os.chown(link, OTHER_UID, OTHER_UID, follow_symlinks=False)
        with pytest.raises(KVTierConfigError,
                           match=rf"reached through the symbolic link {link}, owned by uid"):
            file_tier(link / "cache")
    owned = tmp_path / "own-link"  # a link of this user's (or root's) own is this user's choice
    owned.symlink_to(real)
    os.chown(owned, os.geteuid(), os.getegid(), follow_symlinks=False)
    tier = file_tier(owned / "cache")
    asyncio.run(tier.close())


def test_a_relative_path_with_dotdot_is_checked_as_it_resolves(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    tier = file_tier(Path("../cache"))
    try:
        assert tier.root == tmp_path / "cache" and tier.directory.is_dir()
    finally:
        asyncio.run(tier.close())


def test_key_derived_paths_never_leave_the_cache_directory(tmp_path: Path) -> None:
    groups = (0, 1, 7, 1000)
    tier = FileTier("file", dict.fromkeys(groups, LAYOUT), dict.fromkeys(groups, 16 * BLOCK),
                    root=tmp_path / "cache", namespace="ns")

    @settings(max_examples=300, deadline=None)
    @given(block_hash=st.binary(min_size=1, max_size=64), group=st.sampled_from(groups))
    def check(block_hash: bytes, group: int) -> None:
        path = os.path.realpath(tier.path_of(BlockKey(block_hash, group)))
        assert os.path.commonpath([path, str(tier.directory)]) == str(tier.directory)
        assert Path(path).parent.parent.parent == tier.directory

    try:
        check()
    finally:
        asyncio.run(tier.close())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(namespace=st.text(min_size=0, max_size=40))
def test_a_namespace_never_leads_out_of_the_cache_root(tmp_path: Path, namespace: str) -> None:
    root = tmp_path / "root"
    try:
        tier = FileTier("file", {0: LAYOUT}, {0: 4 * BLOCK}, root=root, namespace=namespace)
    except (KVTierConfigError, TierUnavailable):
        return
    try:
        directory = os.path.realpath(tier.directory)
        assert os.path.dirname(directory) == os.path.realpath(root)
        key = universe(1, tag=namespace)[0]
        assert asyncio.run(tier.put([key], [expected_bytes(key)])) == [True]
        assert os.path.realpath(tier.path_of(key)).startswith(directory + os.sep)
    finally:
        asyncio.run(tier.close())
        shutil.rmtree(root, ignore_errors=True)


def test_writes_with_hostile_hashes_stay_inside(tmp_path: Path) -> None:
    outside = set(os.listdir(tmp_path))
    tier = file_tier(tmp_path / "cache")
    keys = [BlockKey(h, 0)
            for h in (b"../../etc/passwd", b"/", b"\x00", b".", b"..", b"\xff" * 64, b"%2e%2e")]
    try:
        assert asyncio.run(tier.put(keys, [expected_bytes(k) for k in keys])) == [True] * len(keys)
        assert set(os.listdir(tmp_path)) == outside | {"cache"}
        assert {p.parent.parent.parent for p in map(tier.path_of, keys)} == {tier.directory}
    finally:
        asyncio.run(tier.close())


# --- Redis secrets ------------------------------------------------------------------------------------------
SECRET = "s3cr3t-Pa55word-93f1c7"
WRONG = "wr0ng-Pa55word-55e2a0"


def _config_file(tmp_path: Path, redis: dict[str, Any], name: str = "kvtier.yaml") -> Path:
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump(cache_config(cpu_blocks=1, redis=redis, model="secret-model")))
    return path


def test_secrets_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", SECRET)
    monkeypatch.setenv("KVTIER_TEST_CA", str(tmp_path / "ca.pem"))
    cfg = load_config(_config_file(tmp_path, {"url": "rediss://alice:${KVTIER_TEST_REDIS_PASSWORD}@127.0.0.1:6380/0",
                                              "password": "${KVTIER_TEST_REDIS_PASSWORD}",
                                              "tls_ca_file": "${KVTIER_TEST_CA}"}))
    redis = cfg.tiers[1]
    assert redis.password == SECRET and redis.tls_ca_file == str(tmp_path / "ca.pem")
    assert redis.url == f"rediss://alice:{SECRET}@127.0.0.1:6380/0"
    assert SECRET not in repr(cfg) and SECRET not in str(cfg)
    monkeypatch.delenv("KVTIER_TEST_REDIS_PASSWORD")
    with pytest.raises(KVTierConfigError, match=r"^tiers\[1\]\.url: .*KVTIER_TEST_REDIS_PASSWORD is not set"):
        load_config(_config_file(tmp_path, {"url": "redis://:${KVTIER_TEST_REDIS_PASSWORD}@127.0.0.1:6380/0"}))
    literal = load_config(_config_file(tmp_path, {"url": "redis://127.0.0.1:6380/0", "password": "a$b${c"}))
    assert literal.tiers[1].password == "a$b${c"  # only ${NAME} is expanded


@pytest.mark.parametrize("redis", [
    {"url": f"redis://alice:{SECRET}@127.0.0.1:6380/0"},
    {"url": "redis://127.0.0.1:6380/0", "username": "alice", "password": SECRET},
    {"cluster": True, "startup_nodes": ["127.0.0.1:7000"], "password": SECRET},
    {"url": f"rediss://:{SECRET}@127.0.0.1:6380/0", "tls_ca_file": "/etc/ssl/certs/ca-certificates.crt"},
], ids=["url", "user-password", "cluster", "tls"])
def test_kvtier_check_never_prints_a_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            redis: dict[str, Any]) -> None:
    assert kvtier_main(["check", str(_config_file(tmp_path, redis))]) == 0
    printed = capsys.readouterr()
    assert "redis" in printed.out and SECRET not in printed.out + printed.err


@pytest.mark.parametrize("redis", [
    {"url": f"http://alice:{SECRET}@127.0.0.1:6380/0"},
    {"url": f"redis://alice:{SECRET}@127.0.0.1:port/0"},
    {"url": "redis://127.0.0.1:6380/0", "password": 987654321987654321},
    {"url": "redis://127.0.0.1:6380/0", "password": [SECRET]},
], ids=["bad-scheme", "bad-port", "numeric-password", "list-password"])
def test_config_errors_never_print_a_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            redis: dict[str, Any]) -> None:
    path = _config_file(tmp_path, redis)
    with pytest.raises(KVTierConfigError) as error:
        load_config(path)
    shown = str(redis.get("password", SECRET))
    assert error.value.path.startswith("tiers[1]") and shown not in str(error.value)
    assert kvtier_main(["check", str(path)]) == 2
    printed = capsys.readouterr()
    assert "invalid config" in printed.out and shown not in printed.out + printed.err


def _acl_server(redis_servers: Any, users: list[list[str]]) -> Any:
    args = ["--user", "default", "off"]
    for user in users:
        args += ["--user", *user]
    return redis_servers(args, auth=(users[0][0], users[0][2][1:]))


def test_password_and_acl_user_from_the_environment_never_reach_the_logs(
        redis_servers: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    server = _acl_server(redis_servers, [["kvtier", "on", f">{SECRET}", "~kvtier:*", "+@all"]])
    monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", SECRET)
    monkeypatch.setenv("KVTIER_TEST_WRONG_PASSWORD", WRONG)
    caplog.set_level(logging.DEBUG)
    keys = universe(6, tag="acl")
    for password, works in (("${KVTIER_TEST_REDIS_PASSWORD}", True),
                            ("${KVTIER_TEST_WRONG_PASSWORD}", False)):
        redis = {"url": f"redis://127.0.0.1:{server.port}/0", "username": "kvtier", "password": password,
                 "timeout": 1.0, "connect_timeout": 1.0}
        oracle = Oracle()
        with TieredCache.from_config(cache_config(cpu_blocks=1, redis=redis)) as cache:
            for i in range(len(keys)):  # one at a time: each store evicts (demotes) the previous block
                oracle.store(cache, keys[i:i + 1])
            hits = sum(oracle.load(cache, [k]) or 0 for k in keys[:-1])
            stats = tier_stats(cache, "redis")
        oracle.assert_clean()
        if works:
            assert hits == len(keys) - 1 and stats.hits == hits
        else:
            assert hits == 0 and stats.errors.get("auth", 0) >= 1, stats.errors
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert "redis" in logged.lower()  # the failures were logged …
    assert SECRET not in logged and WRONG not in logged  # … without either password


def test_namespaces_keep_tenants_apart_and_an_acl_key_pattern_enforces_it(redis_servers: Any) -> None:
    model_cfg = cache_config(cpu_blocks=1, redis={"url": "redis://127.0.0.1:1/0"}, model="tenant-a")
    loaded = load_config(model_cfg)
    ns_a = build_namespace(loaded, build_spec(loaded)).id
    server = _acl_server(redis_servers, [["tenant-a", "on", ">pw-a", f"~kvtier:{ns_a}:*", "+@all"]])
    keys = universe(4, tag="tenants")

    def cache_of(model: str) -> TieredCache:
        redis = {"url": f"redis://127.0.0.1:{server.port}/0", "username": "tenant-a", "password": "pw-a",
                 "timeout": 1.0, "connect_timeout": 1.0}
        return TieredCache.from_config(cache_config(cpu_blocks=1, redis=redis, model=model))

    oracle = Oracle()
    with cache_of("tenant-a") as a:
        assert a.core.namespace is not None and a.core.namespace.id == ns_a
        for i in range(len(keys)):
            oracle.store(a, keys[i:i + 1])
        assert sum(oracle.load(a, [k]) or 0 for k in keys[:-1]) == len(keys) - 1
    with cache_of("tenant-b") as b:  # same keys, another model: another namespace, outside the ACL pattern
        assert b.lookup(keys) == 0
        for i in range(len(keys)):
            oracle.store(b, keys[i:i + 1])
        assert sum(oracle.load(b, [k]) or 0 for k in keys[:-1]) == 0
        assert tier_stats(b, "redis").errors.get("auth", 0) >= 1  # NOPERM: the server refuses the key
    oracle.assert_clean()


def test_tls_with_a_password_from_the_environment(redis_servers: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from tests.tiers.conftest import RedisProcess, free_port, make_test_certificates

    ca, cert, key = make_test_certificates(tmp_path)

    port = free_port()
    server = RedisProcess(port, tmp_path / "tls", ["--port", "0", "--tls-port", str(port),
                                                   "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                                                   "--tls-ca-cert-file", str(ca),
                                                   "--tls-auth-clients", "no", "--requirepass", SECRET])
    server.start(wait=False)
    try:
        monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", SECRET)
        monkeypatch.setenv("KVTIER_TEST_CA", str(ca))
        redis = {"url": f"rediss://:${{KVTIER_TEST_REDIS_PASSWORD}}@127.0.0.1:{port}/0",
                 "tls_ca_file": "${KVTIER_TEST_CA}", "timeout": 1.0, "connect_timeout": 1.0,
                 "circuit_breaker": {"failures": 1000, "cooldown_seconds": 0.1}}
        path = _config_file(tmp_path, redis)
        assert kvtier_main(["check", str(path)]) == 0
        assert SECRET not in capsys.readouterr().out
        keys = universe(3, tag="tls")
        with TieredCache.from_config(path) as cache:
            tier = cache.core.tiers[1]
            blocks = [expected_bytes(k) for k in keys]
            deadline = time.monotonic() + 10
            while not all(cache._call(tier.put(keys, blocks))):  # the server may still be starting
                if server.process is not None and server.process.poll() is not None:
                    pytest.skip("this redis-server was built without TLS")
                assert time.monotonic() < deadline, tier.counters.errors
                time.sleep(0.05)
            out = [torch.empty(BLOCK, dtype=torch.uint8) for _ in keys]
            assert cache._call(tier.get(keys, out)) == [True] * 3
            assert all(torch.equal(a, b) for a, b in zip(out, blocks, strict=True))
    finally:
        server.kill()
