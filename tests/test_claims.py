"""The studies' shared claim records and capacity search (experiments/claims.py)."""

import pytest

from experiments import claims


def test_a_claim_holds_fails_or_says_why_it_cannot_decide():
  assert claims.claim("x", True, "e")["verdict"] == "holds"
  assert claims.claim("x", False, "e")["verdict"] == "fails"
  record = claims.claim("x", None, "e", why="one chunk size", premises={"slo_s": 0.05})
  assert record["verdict"] == "undecided: one chunk size"
  assert record["premises"] == {"slo_s": 0.05} and record["holds"] is None


def test_an_optimum_is_bracketed_only_inside_three_values_or_more():
  assert claims.bracketed([0.3, 0.05, 0.15], 0.15)
  assert not claims.bracketed([0.05, 0.15, 0.3], 0.3)
  assert not claims.bracketed([0.05, 0.15, 0.3], 0.05)
  assert not claims.bracketed([0.05, 0.3], 0.3)


@pytest.mark.parametrize("start", [0.1, 1.0, 3.0, 16.0])
def test_the_capacity_search_finds_where_the_slo_breaks(start):
  capacity = claims.search_capacity(lambda rate: rate <= 3.7, start, max_rate=64.0)
  assert capacity.reached and capacity.rate <= 3.7 < capacity.broken_at
  assert capacity.broken_at - capacity.rate <= 0.05 * capacity.broken_at
  assert all(ok == (rate <= 3.7) for rate, ok in capacity.probes)
  assert capacity.to_dict()["reached"] is True


def test_a_capacity_past_the_search_is_a_lower_bound_not_a_capacity():
  capacity = claims.search_capacity(lambda rate: True, 1.0, max_rate=10.0)
  assert not capacity.reached and capacity.rate == 10.0 and capacity.broken_at is None


def test_no_capacity_when_even_the_lowest_rate_breaks():
  capacity = claims.search_capacity(lambda rate: False, 1.0, max_rate=10.0, min_rate=0.1)
  assert capacity.rate is None and capacity.broken_at == pytest.approx(0.125)
  with pytest.raises(ValueError, match="starts inside"):
    claims.search_capacity(lambda rate: True, 0.0, max_rate=10.0)


def test_the_downward_search_stops_without_a_floor():
  capacity = claims.search_capacity(lambda rate: False, 1.0, max_rate=10.0)
  assert capacity.rate is None and len(capacity.probes) <= 12
