"""A blocking call made on the cache's own loop thread — from a done-callback of a ``submit_*`` future, the
natural way to chain a store after a load — is refused with :class:`CalledOnLoopThread` at once, instead of
waiting on itself forever (and taking the cache and ``close()`` with it)."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import pytest
import torch

from kvtier import CalledOnLoopThread, TieredCache
from tests.helpers import make_keys, random_blocks


def _on_loop_callback(cache: TieredCache, call: Any) -> dict[str, Any]:
    """Run ``call()`` in a done-callback of a future that the cache's loop completes, so on the loop thread
    (where a ``submit_*`` future's callbacks run); its result or exception, within 10 s."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def callback(_: concurrent.futures.Future[int]) -> None:
        box["thread"] = threading.current_thread().name
        try:
            box["result"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
        done.set()

    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    future.add_done_callback(callback)
    cache._loop.call_soon_threadsafe(future.set_result, 0)  # noqa: SLF001 - the loop completes it
    assert done.wait(10), "the callback never finished: the loop thread waits on itself"
    assert box["thread"] == "kvtier-loop"
    return box


@pytest.mark.parametrize("tiers", ["cpu+file", "cpu"])
def test_blocking_calls_in_a_done_callback_are_refused(two_tier_config: dict[str, Any], tiers: str) -> None:
    config = dict(two_tier_config, tiers=two_tier_config["tiers"][:1] if tiers == "cpu" else
                  two_tier_config["tiers"])
    with TieredCache.from_config(config) as cache:
        layout = cache.spec.groups[0].layout
        keys, blocks = make_keys(2), random_blocks(2, layout, seed=3)
        out = torch.zeros_like(blocks)
        refused = {
            "lookup": lambda: cache.lookup(keys),
            "load": lambda: cache.load(keys, out),
            "store": lambda: cache.store(make_keys(2, start=10), blocks),
            "clear": lambda: cache.clear([0]),
            "close": cache.close,
        }
        for name, call in refused.items():
            box = _on_loop_callback(cache, call)
            assert isinstance(box.get("error"), CalledOnLoopThread), (name, box)
            assert f"TieredCache.{name}()" in str(box["error"])

        # what does not wait answers there: stats, and a submit whose future the callback does not wait on
        assert cache.store(keys, blocks) == 2
        assert _on_loop_callback(cache, cache.stats)["result"].stored_blocks == 2
        box = _on_loop_callback(cache, lambda: cache.submit_load(keys, out))
        assert box["result"].result(timeout=10) == 2 and torch.equal(out, blocks)

        # nothing was lost or left pinned: the cache serves from other threads, and closes promptly
        assert cache.lookup(keys) == 2
        out.zero_()
        assert cache.load(keys, out) == 2 and torch.equal(out, blocks)
    assert cache.closed
