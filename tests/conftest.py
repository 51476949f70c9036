"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import SMALL_MODEL, small_layout


@pytest.fixture
def two_tier_config(tmp_path: Path) -> dict[str, Any]:
    """CPU tier of 4 blocks over a file tier of 16 blocks (16 KiB blocks)."""
    block = small_layout().nbytes
    return {
        "model": dict(SMALL_MODEL),
        "hash_block_size": 16,
        "tiers": [
            {"type": "cpu", "capacity": 4 * block},
            {"type": "file", "path": str(tmp_path / "files"), "capacity": 16 * block},
        ],
    }
