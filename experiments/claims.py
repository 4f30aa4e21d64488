"""What the studies share to state a claim that can fail, hold, or say it cannot decide.

  claim(text, holds, evidence, why)   a claim's record: `verdict` is "holds", "fails" or
                                      "undecided: <why>" (when `holds` is None)
  search_capacity(meets, start, ...)  the highest rate at which `meets(rate)` holds, found
                                      by doubling until it breaks, then bisection; says
                                      so when it never breaks below `max_rate`
  bracketed(values, best)             whether a sweep's optimum lies inside its range

A claim's thresholds (SLOs, capacities, margins) go in its record beside the verdict,
as `premises`, so `study.json` and the figures show what decided it.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def verdict(holds: bool | None, why: str = "") -> str:
  """"holds", "fails", or "undecided: why" when `holds` is None."""
  if holds is None:
    return f"undecided: {why}" if why else "undecided"
  return "holds" if holds else "fails"


def claim(text: str, holds: bool | None, evidence: str, *, why: str = "",
          premises: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """A claim's record for `study.json`: the claim, its verdict, the evidence, and the
  thresholds it was judged by."""
  return dict(claim=text, verdict=verdict(holds, why), holds=holds, evidence=evidence,
              premises=dict(premises or {}))


def bracketed(values: Sequence[float], best: float) -> bool:
  """Whether the optimum `best` of a sweep over `values` lies strictly inside it: three
  values or more, and `best` at neither end (else the optimum may lie past the range)."""
  ordered = sorted(values)
  return len(ordered) >= 3 and ordered[0] < best < ordered[-1]


@dataclasses.dataclass(frozen=True)
class Capacity:
  """The result of `search_capacity`: the highest rate found to meet the SLO and the
  lowest found to break it (None: it never broke below `max_rate`), with every probe."""

  rate: float | None  # None: not even the lowest probed rate meets it
  broken_at: float | None
  probes: tuple[tuple[float, bool], ...]

  @property
  def reached(self) -> bool:
    """Whether the search found where the SLO breaks (a capacity, not a lower bound)."""
    return self.broken_at is not None

  def to_dict(self) -> dict[str, Any]:
    return dict(rate=self.rate, broken_at=self.broken_at, reached=self.reached,
                probes=[list(probe) for probe in self.probes])


def search_capacity(meets: Callable[[float], bool], start: float, *, max_rate: float,
                    min_rate: float = 0.0, relative_tolerance: float = 0.05,
                    growth: float = 2.0) -> Capacity:
  """The highest arrival rate at which `meets(rate)` (the SLO holds), by search: from
  `start`, grow by `growth` until it breaks (or `max_rate` is probed), shrink the same
  way if `start` already breaks (down to `min_rate`, and never below `start` / 1024),
  then bisect the bracket until it
  is within `relative_tolerance` of its upper end. Assumes the SLO, once broken, stays
  broken at higher rates (what each probe's record lets a reader check)."""
  if not 0 < start <= max_rate:
    raise ValueError(f"the search starts inside (0, max_rate={max_rate}], got {start}")
  probes: list[tuple[float, bool]] = []

  def probe(rate: float) -> bool:
    ok = bool(meets(rate))
    probes.append((rate, ok))
    return ok

  low: float | None = None
  high: float | None = None
  rate = start
  if probe(rate):
    low = rate
    while low < max_rate:
      rate = min(max_rate, low * growth)
      if not probe(rate):
        high = rate
        break
      low = rate
    if high is None:
      return Capacity(low, None, tuple(probes))
  else:
    high = rate
    while True:
      rate = high / growth
      if rate < max(min_rate, start / 1024):
        return Capacity(None, high, tuple(probes))
      if probe(rate):
        low = rate
        break
      high = rate
  while high - low > relative_tolerance * high:
    middle = 0.5 * (low + high)
    if probe(middle):
      low = middle
    else:
      high = middle
  return Capacity(low, high, tuple(probes))
