"""A process forked after it made a cache: the inherited cache refuses every call at once, the child can
make its own, and neither exit nor the parent's cache is disturbed.

The fork happens in a fresh interpreter (a subprocess), not in pytest's: a child of a process with live
threads inherits their locks held, which is what the cache must survive, but pytest must not.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import SMALL_MODEL

_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    torch.set_num_threads(1)  # torch's own OpenMP pool would hang a forked child on its first op
    from kvtier import CacheClosed, CacheForked, TieredCache
    from tests.helpers import make_keys, random_blocks

    config, parent_dir, child_dir = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]

    def make(directory):
        cfg = dict(config, tiers=[{"type": "cpu", "capacity": "8MiB"},
                                  {"type": "file", "path": directory, "capacity": "32MiB"}])
        return TieredCache.from_config(cfg)

    cache = make(parent_dir)
    layout = cache.spec.groups[0].layout
    keys, other = make_keys(16), make_keys(16, start=100)
    blocks = random_blocks(16, layout, seed=1)
    out = torch.zeros_like(blocks)
    assert cache.store(keys, blocks) == 16
    cache.submit_store(other, blocks).result()

    pid = os.fork()
    if pid == 0:
        refused = {}
        calls = {
            "lookup": lambda: cache.lookup(keys),
            "load": lambda: cache.load(keys, out),
            "store": lambda: cache.store(make_keys(4, start=500), blocks[:4]),
            "submit_load": lambda: cache.submit_load(keys, out),
            "submit_store": lambda: cache.submit_store(make_keys(4, start=600), blocks[:4]),
            "lease": lambda: cache.lease(keys),
            "read_leased": lambda: cache.read_leased(keys[:1], [0], out[:1]),
            "clear": lambda: cache.clear([0]),
            "stats": lambda: cache.stats(),
            "add_watcher": lambda: cache.add_watcher(object()),
            "core.lookup": lambda: __import__("asyncio").run(cache.core.lookup(keys)),
            "core.plan_store": lambda: cache.core.plan_store(make_keys(2, start=700)),
        }
        for name, call in calls.items():
            try:
                call()
                refused[name] = "returned"
            except CacheForked as exc:
                named = isinstance(exc, CacheClosed) and "forked child" in str(exc)
                refused[name] = "CacheForked" if named else repr(exc)
            except Exception as exc:  # noqa: BLE001 - the test reports whatever it was
                refused[name] = repr(exc)
        cache.release(keys, [0] * 16)  # no-ops, as after close
        closed_before = cache.closed
        cache.close()
        fresh = make(child_dir)  # the child's own cache works
        assert fresh.store(keys, blocks) == 16
        assert fresh.load(keys, out) == 16 and torch.equal(out, blocks)
        fresh.close()
        print(json.dumps({"refused": refused, "closed": closed_before, "fresh": True}), flush=True)
        sys.exit(0)  # a normal exit: atexit and threading's exit hooks run in the child
    _, status = os.waitpid(pid, 0)
    out.zero_()
    ok = cache.load(keys, out) == 16 and torch.equal(out, blocks)
    stats = cache.stats()
    cache.close()
    print(json.dumps({"child_status": status, "parent_load_ok": ok, "parent_stores": stats.stored_blocks}))
''')


def test_forked_child_refuses_the_inherited_cache_and_can_make_its_own(tmp_path: Path) -> None:
    config = {"model": SMALL_MODEL, "hash_block_size": 16}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(config), str(tmp_path / "parent"),
         str(tmp_path / "child")], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    child, parent = (json.loads(line) for line in result.stdout.strip().splitlines()[-2:])
    assert child["refused"] == dict.fromkeys(child["refused"], "CacheForked"), child["refused"]
    assert len(child["refused"]) == 12
    assert child["closed"] is True and child["fresh"] is True
    assert parent["child_status"] == 0
    assert parent["parent_load_ok"] is True
    assert parent["parent_stores"] == 32  # the child's refused stores never reached the parent's figures
    # the parent persisted on close, the child's exit wrote nothing for it: 32 blocks in its file tier
    assert len(list((tmp_path / "parent").rglob("*.kvb"))) == 32
