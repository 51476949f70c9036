"""Placement rules: YAML options validated with key paths, and what each rule does in a replay."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.blocks import BlockKey
from kvtier.config import build_cache_parts, load_config
from kvtier.errors import KVTierConfigError
from kvtier.policy.admission import AdmitAll, SecondSighting, TinyLFUAdmission, make_admission_policy
from kvtier.policy.placement import PlacementPolicy
from kvtier.replay import replay
from kvtier.traces import Trace


@pytest.mark.parametrize(("change", "path"), [
    (lambda c: c.update(placement={"write_mode": "write_sideways"}), "placement.write_mode"),
    (lambda c: c.update(placement={"promote_on_hit": "often"}), "placement.promote_on_hit"),
    (lambda c: c.update(placement={"promote_to": -1}), "placement.promote_to"),
    (lambda c: c.update(placement={"promote_to": 2}), "placement.promote_to=2"),
    (lambda c: c.update(placement={"keep_lower_copy": "maybe"}), "placement.keep_lower_copy"),
    (lambda c: c.update(placement={"admission_history": 0}), "placement.admission_history"),
    (lambda c: c.update(placement={"write_back": True}), "placement.write_back"),
    (lambda c: c["tiers"][1].update(admission="third_sighting"), "tiers[1].admission"),
    (lambda c: c["tiers"][0].update(eviction="clairvoyant"), "tiers[0].eviction"),
])
def test_bad_placement_options_name_their_key_path(two_tier_config: dict[str, Any], change: Any,
                                                   path: str) -> None:
    change(two_tier_config)
    with pytest.raises(KVTierConfigError) as info:
        load_config(two_tier_config)
    assert path in str(info.value)


def test_good_placement_options_reach_the_residency(two_tier_config: dict[str, Any]) -> None:
    two_tier_config["placement"] = {"write_mode": "write_through", "promote_on_hit": False,
                                    "keep_lower_copy": False, "admission_history": 128}
    two_tier_config["tiers"][1]["admission"] = "second_sighting"
    two_tier_config["tiers"][0]["eviction"] = "lifetime"
    _, _, residency, _ = build_cache_parts(load_config(two_tier_config))
    rules = residency.placement
    assert (rules.write_mode, rules.promote_on_hit, rules.keep_lower_copy) == ("write_through", False, False)
    assert isinstance(rules.admission[0], AdmitAll)
    assert isinstance(rules.admission[1], SecondSighting) and rules.admission[1].history == 128
    assert residency.tiers[0].policies[0].name == "lifetime"


def test_tinylfu_admission_from_yaml_admits_on_the_second_offer(two_tier_config: dict[str, Any]) -> None:
    two_tier_config["tiers"][1]["admission"] = "tinylfu"
    _, _, residency, _ = build_cache_parts(load_config(two_tier_config))
    doorkeeper = residency.placement.admission[1]
    assert isinstance(doorkeeper, TinyLFUAdmission)
    key = BlockKey(b"\x07" * 16, 0)
    assert [doorkeeper.admit(key), doorkeeper.admit(key)] == [False, True]


def test_placement_policy_validates_itself() -> None:
    with pytest.raises(ValueError, match="write_mode"):
        PlacementPolicy([AdmitAll()], write_mode="write_sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="promote_to"):
        PlacementPolicy([AdmitAll(), AdmitAll()], promote_to=2)
    with pytest.raises(KeyError, match="known"):
        make_admission_policy("third_sighting")


def _two_turns() -> Trace:
    keys = [BlockKey(i.to_bytes(8, "little"), 0) for i in range(8)]
    requests = [keys[:4], keys[4:8], keys[:4], keys[:4]]
    return Trace("t", "synthetic", 16, [list(r) for r in requests], [64] * 4, 8)


def rules(**kwargs: Any) -> PlacementPolicy:
    admission = kwargs.pop("admission", [AdmitAll(), AdmitAll()])
    return PlacementPolicy(admission, **kwargs)


def test_write_back_demotes_and_lower_hits_are_promoted() -> None:
    result = replay(_two_turns(), "lru", [4, 8], rules())
    top, low = result.tiers
    assert low.demoted_in == 8  # pushed down by the second request, then by the promotion
    assert low.hits == 4 and top.hits == 4  # turn 3 hits below (then promoted), turn 4 on top
    assert top.promoted_in == 4
    assert result.block_hits == 8


def test_write_through_writes_every_tier_and_never_demotes() -> None:
    result = replay(_two_turns(), "lru", [4, 8], rules(write_mode="write_through"))
    top, low = result.tiers
    assert low.demoted_in == 0
    assert low.written == 8 and top.written == 8 + 4  # stores, plus the promotion back up


def test_no_promotion_serves_from_below() -> None:
    result = replay(_two_turns(), "lru", [4, 8], rules(promote_on_hit=False))
    top, low = result.tiers
    assert top.promoted_in == 0 and low.hits == 8


def test_exclusive_promotion_drops_the_lower_copy() -> None:
    inclusive = replay(_two_turns(), "lru", [4, 8], rules())
    exclusive = replay(_two_turns(), "lru", [4, 8], rules(keep_lower_copy=False))
    assert exclusive.tiers[1].hits == inclusive.tiers[1].hits == 4
    assert exclusive.block_hits == inclusive.block_hits


def test_second_sighting_keeps_one_hit_wonders_out_of_the_lower_tier() -> None:
    result = replay(_two_turns(), "lru", [4, 8], rules(admission=[AdmitAll(), SecondSighting(64)]))
    assert result.tiers[1].demoted_in == 0  # each block was offered to it once only
