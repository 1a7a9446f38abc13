"""The run page's episode filters as read from its query string, and the compare palette."""

from __future__ import annotations

import pytest
from starlette.datastructures import QueryParams

from gateway.dashboard.analysis import MAX_COMPARED, PALETTE, episode_filters


def test_filters_typed_and_parsed() -> None:
    raw, parsed = episode_filters(
        QueryParams("reward_min=0.5&version=3&length_min=10&length_max=&drift=false&group_id=g1")
    )
    assert raw["length_max"] is None and raw["reward_min"] == "0.5"  # refills the form
    assert parsed == {
        "status": None,
        "reward_min": 0.5,
        "reward_max": None,
        "version": 3,
        "length_min": 10,
        "length_max": None,
        "drift": False,
        "group_id": "g1",
    }
    assert episode_filters(QueryParams("drift=true"))[1]["drift"] is True
    assert set(episode_filters(QueryParams(""))[1].values()) == {None}


@pytest.mark.parametrize(
    ("query", "field"),
    [("drift=maybe", "drift"), ("version=1.5", "version"), ("length_min=ten", "length_min")],
)
def test_a_bad_filter_names_its_field(query: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        episode_filters(QueryParams(query))


def test_each_compared_run_has_its_own_colour() -> None:
    assert len(set(PALETTE)) == len(PALETTE) == MAX_COMPARED
