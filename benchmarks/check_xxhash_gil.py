"""Does the installed ``xxhash`` release the GIL while it hashes? Not a test: prints the evidence.

One thread hashes a large buffer; a pure-Python thread records the longest gap between its loop turns.
A call that holds the GIL stalls the other thread for the whole call (the ``bytes()`` copy control); one
that releases it leaves gaps near the interpreter's switch interval (the ``hashlib`` control). Timing
two threads against one says nothing on a busy 2-core machine, where a neighbour takes the second
core: this check holds under load.

Usage: ``python benchmarks/check_xxhash_gil.py [--mib 512]``
"""

from __future__ import annotations

import argparse
import hashlib
import threading
import time
from collections.abc import Callable

import numpy as np
import xxhash


def longest_gap(call: Callable[[], object], repeat: int = 5) -> float:
    """Seconds of the longest stall a pure-Python thread saw while ``call`` ran ``repeat`` times."""
    done = threading.Event()
    worst = [0.0]

    def spin() -> None:
        last = time.perf_counter()
        while not done.is_set():
            now = time.perf_counter()
            worst[0] = max(worst[0], now - last)
            last = now

    spinner = threading.Thread(target=spin)
    spinner.start()
    time.sleep(0.01)
    for _ in range(repeat):
        call()
    done.set()
    spinner.join()
    return worst[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="buffer size")
    args = parser.parse_args()
    buf = np.random.default_rng(0).integers(0, 256, args.mib << 20, dtype=np.uint8)
    view = memoryview(buf)

    def streaming() -> int:
        digest = xxhash.xxh3_64()
        digest.update(view)
        return digest.intdigest()

    cases: dict[str, Callable[[], object]] = {
        "xxh3_64_intdigest (one call)": lambda: xxhash.xxh3_64_intdigest(view),
        "xxh3_64().update (streaming, as the tiers use it)": streaming,
        "control, GIL released: hashlib.md5": lambda: hashlib.md5(view).digest(),
        "control, GIL held: bytes() copy": lambda: bytes(view),
    }
    print(f"xxhash {xxhash.VERSION} (libxxhash {xxhash.XXHASH_VERSION}), {args.mib} MiB buffer")
    for name, call in cases.items():
        start = time.perf_counter()
        call()
        took = time.perf_counter() - start
        gap = longest_gap(call)
        verdict = "held" if gap > 0.8 * took else "released"
        print(f"{name:50s} one call {took * 1e3:7.1f} ms, longest stall of the other thread "
              f"{gap * 1e3:7.1f} ms -> GIL {verdict}")


if __name__ == "__main__":
    main()
