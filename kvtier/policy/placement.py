"""Placement across tiers: where a stored block lands, what happens on eviction and on a hit.

- ``write_back`` (default): a store lands in the top tier that admits it; a block evicted from a
  tier is demoted to the next lower tier that admits it (unless a copy is already there).
- ``write_through``: a store is written to every tier that admits it; eviction just drops.
- ``promote_on_hit``: a hit in a lower tier is copied up to ``promote_to`` (tier index);
  ``keep_lower_copy`` keeps the lower copy (inclusive caching: a later eviction of the promoted
  block costs no write), otherwise the lower copy is deleted (exclusive caching: more capacity).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvtier.policy.admission import AdmissionPolicy

WriteMode = Literal["write_back", "write_through"]


@dataclass
class PlacementPolicy:
    """Placement rules plus one admission policy per tier (index 0 = top)."""

    admission: Sequence[AdmissionPolicy]
    write_mode: WriteMode = "write_back"
    promote_on_hit: bool = True
    promote_to: int = 0
    keep_lower_copy: bool = True

    def __post_init__(self) -> None:
        if self.write_mode not in ("write_back", "write_through"):
            raise ValueError(f"write_mode must be 'write_back' or 'write_through', got {self.write_mode!r}")
        if self.admission and not 0 <= self.promote_to < len(self.admission):
            raise ValueError(f"promote_to={self.promote_to} is not a tier index "
                             f"(0..{len(self.admission) - 1})")

    @property
    def num_tiers(self) -> int:
        return len(self.admission)

    def should_promote(self, hit_tier: int) -> bool:
        return self.promote_on_hit and hit_tier > self.promote_to
