"""What a step costs, learned from the steps the server ran: the wait forecast's clock.

A step's time grows with the tokens it computes (the matmuls: prefill-heavy steps are
compute-bound) and with the context its sequences attend to (the KV reads: decode
steps are bandwidth-bound), on top of a fixed launch cost:

    seconds ~ launch + per_token x num_batched_tokens + per_context x num_context_tokens

Steps of two kinds are kept and fit apart, each over its most recent samples: steps that
carry prefill tokens (compute-bound) and decode-only steps (bandwidth-bound). One line
through both would misprice each, since a step costs the larger of its compute and its
memory time, not their sum; and keeping both means a burst of decodes does not erase
what a prefill costs. A kind with too few samples borrows the fit of all steps, and then
costs no less than the cheapest step seen: a prefill-bound history (every step a full
2,048-token budget while a burst queues) says nothing about the weight-read floor that
decode steps pay, and pricing them down the prefill line would forecast them 4x too
fast. The coefficients are non-negative, fit by least squares on relative error (a 20 ms
step matters as much as a 300 ms one), then scaled up by the fit's own relative error
(root mean square over its samples; `BORROWED_ERROR` for a kind that borrows): the
forecast built on them should be late by a little rather than early, since a client told
to come back early is refused again. A fixed mean step time, the obvious alternative, is
off by the ratio of the two kinds: about 7x on the simulated 13B A100 (0.28 s for a
2,048-token prefill step, 0.04 s to decode a batch of 66).

The samples are the scheduler's own view of a step (from the previous step's return,
while it has work, to samples back), so the model includes host overhead (the outputs
handed over, arrivals answered, the batch scheduled) and, on a real device, whatever
the roofline misses.
A sample far above what the fit predicts (a compilation: seconds, where steps take
milliseconds) is left out. A fit is kept until an eighth of the samples it was fit on
have been replaced by new steps (every step while there are fewer than 16): refitting
after every step, as admission asked for a forecast between each, took ~9% of the
tiny server's one core at 5x overload (165 arrivals/s, ~50 steps/s).

Pure Python + numpy: never imports jax.
"""

import collections
import itertools

import numpy as np

MIN_SAMPLES = 2  # steps before the model predicts anything
REFIT_FRACTION = 8  # refit after 1/REFIT_FRACTION of the samples are new
KIND_SAMPLES = 8  # steps of a kind before it is fit on its own
BORROWED_ERROR = 0.25  # the relative error assumed of a kind priced by the other's fit
OUTLIER = 20.0  # a sample this many times the prediction is a compile, not a step


class StepCostModel:
  """Seconds per step from (tokens computed, context tokens attended), fit online."""

  def __init__(self, window: int = 64):
    # (num_batched_tokens, num_context_tokens, seconds) of steps with prefill tokens
    # (True) and of decode-only steps (False).
    self._samples: dict[bool, collections.deque[tuple[int, int, float]]] = {
        kind: collections.deque(maxlen=window) for kind in (True, False)}
    # The last fit of each kind; refit only when a forecast asks after enough new
    # samples (`REFIT_FRACTION`), so observing a step costs the scheduler next to nothing.
    self._fits: dict[bool, tuple[float, float, float, float] | None] = {}
    self._new = 0  # samples observed since the fits were made
    # Each kind's samples so far, and its own fit with the count it was made at.
    self._seen = dict.fromkeys((True, False), 0)
    self._guards: dict[bool, tuple[int, tuple[float, float, float, float]]] = {}

  def observe(self, num_tokens: int, num_context_tokens: int, seconds: float, *,
              num_sequences: int) -> None:
    """One step (or one iteration of a multi-step launch) and how long it took."""
    if seconds <= 0 or num_tokens <= 0:
      return
    prefill = num_tokens > num_sequences
    # Possibly stale, good enough to spot a compile; before any forecast asked for a
    # fit, the kind's own samples guard it (the first request after warm-up may compile
    # what warm-up did not).
    fit = self._fits.get(prefill) or self._guard(prefill)
    if fit is not None and seconds > OUTLIER * _price(fit, num_tokens, num_context_tokens):
      return
    self._samples[prefill].append((num_tokens, num_context_tokens, seconds))
    self._seen[prefill] += 1
    self._new += 1

  def _guard(self, prefill: bool) -> tuple[float, float, float, float] | None:
    """A fit of the kind's own samples (None with fewer than `MIN_SAMPLES`), kept
    until an eighth of them are new: what a sample is checked against before any
    forecast fit the model."""
    own = self._samples[prefill]
    if len(own) < MIN_SAMPLES:
      return None
    made = self._guards.get(prefill)
    if made is None or self._seen[prefill] - made[0] >= max(1, len(own) // REFIT_FRACTION):
      coefficients, _ = _non_negative_fit(np.array(own, dtype=np.float64))
      launch, per_token, per_context = map(float, coefficients)
      made = (self._seen[prefill], (launch, per_token, per_context, 0.0))
      self._guards[prefill] = made
    return made[1]

  def predict(self, num_tokens: float, num_context_tokens: float,
              prefill: bool) -> float | None:
    """Forecast seconds of a step (`prefill`: whether it carries prefill tokens);
    None before `MIN_SAMPLES` steps were seen."""
    coefficients = self.coefficients(prefill)
    return None if coefficients is None else _price(coefficients, num_tokens,
                                                    num_context_tokens)

  def coefficients(self, prefill: bool) -> tuple[float, float, float, float] | None:
    """(launch s, s per token, s per context token, floor s) for steps with prefill
    tokens or decode-only steps, all >= 0 (the floor is 0 for a kind fit on its own);
    None without data."""
    total = sum(map(len, self._samples.values()))
    if self._new and self._new >= total // REFIT_FRACTION:
      self._fits, self._new = {}, 0
    if prefill not in self._fits:
      own = self._samples[prefill]
      every = [row for samples in self._samples.values() for row in samples]
      fit = None
      if len(own) >= KIND_SAMPLES:
        coefficients, error = _non_negative_fit(np.array(own, dtype=np.float64))
        fit = (*(coefficients * (1.0 + error)), 0.0)
      elif len(every) >= MIN_SAMPLES:
        coefficients, _ = _non_negative_fit(np.array(every, dtype=np.float64))
        fit = (*(coefficients * (1.0 + BORROWED_ERROR)),
               min(seconds for _, _, seconds in every) * (1.0 + BORROWED_ERROR))
      self._fits[prefill] = None if fit is None else tuple(map(float, fit))  # type: ignore[assignment]
    return self._fits[prefill]


def _price(fit: tuple[float, float, float, float], num_tokens: float,
           num_context_tokens: float) -> float:
  launch, per_token, per_context, floor = fit
  return max(floor, launch + per_token * num_tokens + per_context * num_context_tokens)


def _non_negative_fit(rows: np.ndarray) -> tuple[np.ndarray, float]:
  """Least squares of relative error over every subset of the columns of `rows`
  ((tokens, context tokens, seconds) each), keeping the best fit whose coefficients
  are all non-negative (exact non-negative least squares for three columns, without
  scipy), and its root-mean-square relative error. Columns are scaled first: context
  counts run to 10^5 where launch is 1."""
  weights = 1.0 / rows[:, 2]
  features = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]]) * weights[:, None]
  seconds = np.ones(len(rows))  # each step's seconds, divided by itself
  scale = np.maximum(np.abs(features).max(axis=0), 1e-12)
  scaled = features / scale
  best, best_error = np.zeros(features.shape[1]), float(np.sum(seconds ** 2))
  for size in range(1, features.shape[1] + 1):
    for columns in itertools.combinations(range(features.shape[1]), size):
      solution = np.linalg.lstsq(scaled[:, columns], seconds, rcond=None)[0]
      if np.any(solution < 0):
        continue
      error = float(np.sum((scaled[:, columns] @ solution - seconds) ** 2))
      if error < best_error - 1e-15:
        best, best_error = np.zeros(features.shape[1]), error
        best[list(columns)] = solution
  return best / scale, float(np.sqrt(best_error / len(rows)))
