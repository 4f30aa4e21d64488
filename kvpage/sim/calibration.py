"""Fitting a step model's rates to measured step times, and the calibration file.

`fit` takes measured steps (each a `StepWork` and its seconds) and finds the
`StepRates` whose `StepModel` prices them best. When the model's rates carry operator
rates (`StepRates.operators`, fitted on per-operator profiles by
`kvpage.sim.operators.fit`), those price the non-attention work and the all-reduces,
and the steps fit only what they do not cover: the launch, a prompt-carrying step's
extra launch, a step's extra launch after the device idled, the per-sequence cost, and
prefill and decode attention (one bounded least-squares solve). Otherwise (a device
measured only step by step) the steps fit a step-level roofline too (`RegimeRates`):

  * Every part is linear in the inverse of its rate (seconds per FLOP, per byte, per
    sequence, per launch), except the linear layers' `max(FLOPs / C, bytes / W)`. For
    that the fit enumerates which steps are compute-bound: per regime (small, large),
    the steps below a token threshold read weights (memory-bound) and the rest compute,
    for every threshold between the steps' token counts (a coarse grid, then refined);
    each assignment is one bounded least-squares solve (`scipy.optimize.lsq_linear`),
    and the assignment whose *true* prediction (with the max) fits best wins.
  * Rates cannot beat the datasheet: each inverse rate is bounded below by one over
    the hardware's peak (`caps`), and small steps compute no faster than large ones
    (the small regime's seconds per FLOP is the large one's plus a non-negative extra).
  * `weighting="absolute"` (the default) fits seconds, as the simulator adds them up
    along a run, so long steps weigh most; `"relative"` fits each step's relative
    error, so short steps weigh as much as long ones; `"by_kind"` fits seconds with
    each kind of step (decode-only, prompt chunks alone, prompt chunks beside decodes)
    weighing as much in all as each other kind, however many steps it has: in a
    served run a few dozen long mixed steps would otherwise set the rates that price
    thousands of short decode steps.
  * `loss="squares"` (the default) is least squares, so each rate prices the *mean*
    step of its kind; `"absolute"` is least absolute deviations (iteratively
    reweighted least squares, `IRLS_ITERATIONS` solves), which prices the *median*
    step: robust to the long tail of step times on a shared CPU, where one slow step in
    several (a descheduled thread, a cold cache after idling) would otherwise lift
    every step's price.
  * Decode attention and the per-sequence cost are indistinguishable when every
    decode attends to about the same context (a published profile at one context
    length): then (`tie_decode_attention`, chosen automatically by `decode_spread`)
    decode attention reads KV at the small regime's weight bandwidth, or, with
    operator rates, the per-sequence cost is 0 and decode attention takes it all (the
    kernels of the engines profiled read each context once per query head, a cost that
    grows with the context, as a per-sequence constant would not).
  * A step launched after the device idled (`StepWork.after_idle`: a served run's
    `steps.jsonl` gives each step's gap since the last one ended) pays `idle_launch`
    on top, so the cold prompt steps that open a busy spell do not price every prompt
    chunk (a published profile has none: it stays 0).
  * The all-reduce's latency and link bandwidth, and host swaps, are not fit (one
    tensor-parallel degree cannot separate them from launch and per-token costs): their
    seconds, priced by the hardware entry, are taken off each step before fitting.

Each fit records the distribution of its training steps' measured over predicted
seconds (`StepRates.noise_quantiles`), from which the simulator can draw a seeded
multiplicative noise (`--sim_noise`): residuals of a served run are its steps' scatter
(a shared CPU's tail); of a published profile of medians, mostly the model's misfit.

A rate the data never exercises (no compute-bound small step, say) is not identified:
it falls back to its sibling (small compute to large, large bandwidth to small) or to
the hardware's template, and the fit says which.

The file (`save` / `load`): JSON with the rates, the fit's premises (model, tensor
parallel, hardware, samples, weighting, loss) and every training and held-out point.

Pure Python + numpy + scipy: never imports jax.
"""

import csv
import dataclasses
import itertools
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import optimize

from kvpage.sim.hardware import HardwareSpec
from kvpage.sim.operators import Datasheet, OperatorRates
from kvpage.sim.step_model import RegimeRates, StepModel, StepRates, StepWork
from kvpage.sim.workload import check_input_file

MAX_CALIBRATION_BYTES = 64 * 2**20  # a fit's rates and residuals: kilobytes in practice

WEIGHTINGS = ("absolute", "relative", "by_kind")
LOSSES = ("squares", "absolute")
IRLS_ITERATIONS = 20  # reweighted solves for loss="absolute" (the median fit)
# Decode contexts this close to their mean (relative standard deviation) cannot tell
# per-sequence cost from KV reads.
TIE_SPREAD = 0.1
MAX_THRESHOLDS = 24  # per regime, in the coarse pass over memory/compute thresholds
NOISE_QUANTILES = 21  # levels of the recorded residual distribution (StepRates.noise_quantiles)
PROFILE_COLUMNS = ("batch_num_tokens", "batch_num_prefill_tokens", "batch_num_decode_tokens",
                   "batch_size", "batch_execution_time")


@dataclasses.dataclass(frozen=True)
class Sample:
  """One measured step: its work on one device, its seconds, and a label for reports."""

  work: StepWork
  seconds: float
  label: str = ""


@dataclasses.dataclass(frozen=True)
class Fit:
  """A fit's rates and how they were found."""

  rates: StepRates
  weighting: str
  tied_decode_attention: bool
  not_identified: tuple[str, ...]  # rates the samples never exercised (fallbacks)
  rms_relative_error: float  # over the training samples
  loss: str = "squares"  # LOSSES: squared errors (a mean fit) or absolute (a median fit)

  def describe(self) -> list[str]:
    r = self.rates
    lines = [
        f"launch {1e3 * r.launch_s:.3f} ms (+ {1e3 * r.prefill_launch_s:.3f} ms with prompt "
        f"chunks, + {1e3 * r.idle_launch_s:.3f} ms after the device idled), per sequence "
        f"{1e3 * r.per_sequence_s:.4f} ms"]
    if r.regimes is not None:
      g = r.regimes
      lines += [
          f"linear, steps < {g.knee_tokens} tokens: {g.small_flops / 1e12:.3g} TFLOP/s, "
          f"weights at {g.small_bandwidth / 1e9:.4g} GB/s",
          f"linear, steps >= {g.knee_tokens} tokens: {g.large_flops / 1e12:.3g} TFLOP/s, "
          f"weights at {g.large_bandwidth / 1e9:.4g} GB/s"]
    else:
      o = r.operators
      assert o is not None
      lines.append(
          f"non-attention work (not fit): operator rates, GEMMs at up to "
          f"{100 * o.gemm_peak_fraction:.0f}% of {o.measured_on.peak_flops / 1e12:.4g} "
          f"TFLOP/s (half at {o.gemm_half_tokens:.0f} tokens), weights at "
          f"{o.gemm_bandwidth / 1e9:.4g} GB/s, elementwise at "
          f"{o.elementwise_bandwidth / 1e9:.4g} GB/s ({o.source})")
    lines += [
        f"prefill attention {r.prefill_attention_flops / 1e12:.3g} TFLOP/s; decode "
        f"attention reads KV at {r.decode_attention_bandwidth / 1e9:.4g} GB/s"
        + (self._tie_note() if self.tied_decode_attention else ""),
        "all-reduce (not fit): " + (
            f"the {r.operators.network} profile for profiled group sizes, else "
            if r.operators else "") + f"{1e6 * r.allreduce_latency_s:.0f} us + bytes at "
        f"{r.link_bandwidth / 1e9:.4g} GB/s",
        f"weighting {self.weighting}, {self.loss} loss; RMS relative error "
        f"{100 * self.rms_relative_error:.1f}%"
        + ("; steps counted at their padded shapes (the simulator pads likewise)"
           if r.padded_work else "")
        + (", every decode row read to the step's longest context" if r.decode_reads_longest
           else "")]
    if self.not_identified:
      lines.append("not identified by these steps (fallbacks): " + ", ".join(self.not_identified))
    return lines

  def _tie_note(self) -> str:
    if self.rates.operators is not None:
      return (" (one context length: per-sequence costs read as KV reads, per_sequence 0)")
    return " (tied to the small steps' weight bandwidth)"


def decode_spread(samples: Sequence[Sample]) -> float:
  """Relative standard deviation of the decode context per sequence over the samples
  with decodes (0 when there are none)."""
  per_sequence = [s.work.decode_kv_bytes / s.work.num_sequences for s in samples
                  if s.work.decode_kv_bytes > 0]
  if len(per_sequence) < 2:
    return 0.0
  return float(np.std(per_sequence) / np.mean(per_sequence))


def _fixed_seconds(model: StepModel, work: StepWork) -> float:
  """The parts the fit does not estimate: all-reduces and swaps, and with operator rates
  the non-attention work."""
  parts = model.price(work).parts
  fixed = parts["allreduce"] + parts["swap"]
  return fixed + (parts["non_attention"] if model.rates.operators is not None else 0.0)


def _design(works: Sequence[StepWork], knee: int, thresholds: tuple[int, int],
            tie: bool, operators: bool) -> np.ndarray:
  """The least-squares columns, one row per step, for a memory/compute assignment:
  launch, prefill launch, idle launch, sequences, small steps' weight bytes, large steps' weight
  bytes, linear FLOPs, small steps' extra FLOPs, prefill attention FLOPs, decode KV
  bytes (the inverse rates' order everywhere in this module). With `operators` the
  linear columns are empty (operator rates price that work) and, when `tie`, so is the
  sequences column (one context length: its cost is read as KV reads)."""
  rows = []
  for w in works:
    if operators:
      rows.append([1.0, 1.0 if w.has_prefill else 0.0, 1.0 if w.after_idle else 0.0,
                   0.0 if tie else w.num_sequences, 0.0, 0.0, 0.0, 0.0,
                   w.prefill_attention_flops, w.decode_kv_bytes])
      continue
    small = w.num_tokens < knee
    memory = w.num_tokens < thresholds[0 if small else 1]
    busy = 1.0 if w.num_tokens > 0 else 0.0
    weights = w.weight_bytes if memory else 0.0
    flops = 0.0 if memory else w.linear_flops
    rows.append([busy, 1.0 if w.has_prefill else 0.0, 1.0 if w.after_idle else 0.0,
                 w.num_sequences,
                 (weights if small else 0.0) + (w.decode_kv_bytes if tie else 0.0),
                 0.0 if small else weights, flops, flops if small else 0.0,
                 w.prefill_attention_flops, 0.0 if tie else w.decode_kv_bytes])
  return np.array(rows, dtype=np.float64)


def _predict(x: np.ndarray, works: Sequence[StepWork], knee: int, tie: bool,
             operators: bool) -> np.ndarray:
  """Seconds for inverse rates `x` (in `_design`'s column order), with the true max()."""
  launch, prefill_launch, idle_launch, per_seq, small_w, large_w, flops, extra, prefill, \
      decode = x
  out = []
  for w in works:
    launches = (prefill_launch if w.has_prefill else 0.0) + (
        idle_launch if w.after_idle else 0.0)
    if operators:
      out.append(launch + launches + (
          0.0 if tie else per_seq * w.num_sequences) + w.prefill_attention_flops * prefill
          + w.decode_kv_bytes * decode)
      continue
    small = w.num_tokens < knee
    compute = w.linear_flops * (flops + (extra if small else 0.0))
    memory = w.weight_bytes * (small_w if small else large_w)
    kv = w.decode_kv_bytes * (small_w if tie else decode)
    out.append((1.0 if w.num_tokens > 0 else 0.0) * launch + launches + per_seq * w.num_sequences
               + max(compute, memory) + w.prefill_attention_flops * prefill + kv)
  return np.array(out)


def step_kind(work: StepWork) -> str:
  """"decode" (no prompt chunk), "prefill" (prompt chunks only) or "mixed" (both)."""
  if not work.has_prefill:
    return "decode"
  return "mixed" if work.decode_kv_bytes > 0 else "prefill"


def _weights(weighting: str, works: Sequence[StepWork], measured: np.ndarray) -> np.ndarray:
  """Each step's factor on its residual (see the module docstring)."""
  if weighting == "relative":
    return 1.0 / measured
  if weighting == "by_kind":  # squared residuals: each kind's factors square-sum to 1
    kinds = [step_kind(w) for w in works]
    counts = {kind: kinds.count(kind) for kind in set(kinds)}
    return np.array([1.0 / math.sqrt(counts[kind]) for kind in kinds])
  return np.ones(len(works))


def _thresholds(works: Sequence[StepWork], knee: int, small: bool) -> list[int]:
  """Candidate memory/compute thresholds for one regime: each distinct token count of
  its steps (a step is memory-bound below the threshold), plus one above them all."""
  tokens = sorted({w.num_tokens for w in works if (w.num_tokens < knee) == small})
  return [0, *tokens[1:], tokens[-1] + 1] if tokens else [0]


def _thin(candidates: list[int], count: int) -> list[int]:
  """At most `count` of `candidates`, evenly spread, the ends kept."""
  if len(candidates) <= count:
    return candidates
  picks = np.linspace(0, len(candidates) - 1, count).round().astype(int)
  return [candidates[i] for i in sorted(set(picks))]


def fit(samples: Sequence[Sample], model: StepModel, hardware: HardwareSpec, *,
        weighting: str = "absolute", knee_tokens: int | None = None,
        tie_decode_attention: bool | None = None, caps: bool = True,
        padded_work: bool = False, decode_reads_longest: bool = False,
        source: str = "", loss: str = "squares") -> Fit:
  """Rates for `model`'s shapes that best price `samples` (see the module docstring);
  `padded_work`: the samples count padded shapes (`StepRates.padded_work`), and with
  `decode_reads_longest` padded rows read to the longest decode context."""
  if weighting not in WEIGHTINGS:
    raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
  if loss not in LOSSES:
    raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
  samples = [s for s in samples if s.work.num_tokens > 0]
  if len(samples) < 3:
    raise ValueError(f"a fit needs at least 3 measured steps with tokens, got {len(samples)}")
  if any(not (s.seconds > 0 and math.isfinite(s.seconds)) for s in samples):
    raise ValueError("every measured step needs a finite time > 0 s")
  template = StepRates.template(hardware)
  knee = template.regimes.knee_tokens if knee_tokens is None else knee_tokens
  tie = decode_spread(samples) < TIE_SPREAD if tie_decode_attention is None else (
      tie_decode_attention)
  operators = model.rates.operators is not None
  works = [s.work for s in samples]
  y = np.array([s.seconds - _fixed_seconds(model, s.work) for s in samples])
  measured = np.array([s.seconds for s in samples])
  weights = _weights(weighting, works, measured)
  # Lower bounds on the inverse rates: the datasheet's peaks (1000x beyond without caps).
  slack = 1.0 if caps else 1e-3
  lower = np.array([0.0, 0.0, 0.0, 0.0, slack / hardware.hbm_bandwidth,
                    slack / hardware.hbm_bandwidth, slack / hardware.peak_flops, 0.0,
                    slack / hardware.peak_flops, slack / hardware.hbm_bandwidth])
  floor = 1e-3 * float(np.median(np.abs(y * weights)))  # IRLS: no residual counts as 0
  def solve(thresholds: tuple[int, int]) -> tuple[float, np.ndarray]:
    unweighted = _design(works, knee, thresholds, tie, operators)
    scale = np.abs(unweighted * weights[:, None]).max(axis=0)
    used = scale > 0
    scale[~used] = 1.0
    low = np.where(used, lower * scale, 0.0)
    factors = weights
    for _ in range(IRLS_ITERATIONS if loss == "absolute" else 1):
      design = unweighted * factors[:, None] / scale
      scaled = optimize.lsq_linear(design, y * factors, bounds=(low, np.inf)).x
      # Least absolute deviations by reweighting: with factors^2 = weights / |r|, each
      # squared term factors^2 r^2 of the next solve is weights |r|.
      residuals = np.abs(unweighted @ (scaled / scale) - y) * weights
      factors = weights / np.sqrt(np.maximum(residuals, floor))
    solution = np.where(used, scaled / scale, np.nan)
    x = np.where(np.isnan(solution), lower, solution)
    errors = (_predict(x, works, knee, tie, operators) - y) * weights
    return float(np.sum(np.abs(errors)) if loss == "absolute" else np.sum(errors ** 2)), solution

  # A coarse grid of thresholds, then every candidate between the best one's neighbours
  # (one regime at a time): exact for a few dozen distinct token counts, cheap for more.
  candidates = ([[0], [0]] if operators else  # operator rates: no linear columns to assign
                [_thresholds(works, knee, True), _thresholds(works, knee, False)])
  coarse = [_thin(c, MAX_THRESHOLDS) for c in candidates]
  results = {t: solve(t) for t in itertools.product(*coarse)}
  best_thresholds = min(results, key=lambda t: results[t][0])
  for regime in (0, 1):
    chosen = coarse[regime].index(best_thresholds[regime])
    low_t = coarse[regime][max(chosen - 1, 0)]
    high_t = coarse[regime][min(chosen + 1, len(coarse[regime]) - 1)]
    for t in candidates[regime]:
      if low_t < t < high_t:
        trial = tuple(t if i == regime else best_thresholds[i] for i in (0, 1))
        results[trial] = solve(trial)  # type: ignore[index]
    best_thresholds = min(results, key=lambda t: results[t][0])
  best = results[best_thresholds]
  _, solution = best
  rates, missing = _rates(solution, template, knee, tie, source, model.rates.operators)
  rates = dataclasses.replace(rates, padded_work=padded_work, measured_on=Datasheet.of(hardware),
                              decode_reads_longest=padded_work and decode_reads_longest)
  priced = model.with_rates(rates)
  predicted = np.array([priced.price(w).seconds for w in works])
  rms = float(np.sqrt(np.mean((predicted / measured - 1.0) ** 2)))
  # The residuals' distribution, for the simulator's optional step-time noise.
  quantiles = np.quantile(measured / predicted, np.linspace(0.0, 1.0, NOISE_QUANTILES))
  rates = dataclasses.replace(rates, noise_quantiles=tuple(
      float(q) for q in np.maximum.accumulate(quantiles)))
  return Fit(rates=rates, weighting=weighting, tied_decode_attention=tie,
             not_identified=missing, rms_relative_error=rms, loss=loss)


def _rates(solution: np.ndarray, template: StepRates, knee: int, tie: bool, source: str,
           operators: OperatorRates | None) -> tuple[StepRates, tuple[str, ...]]:
  """Inverse rates (NaN: not identified) to `StepRates`, with fallbacks named; with
  `operators`, those price the non-attention work and the fit found the rest."""
  launch, prefill_launch, idle_launch, per_seq, small_w, large_w, flops, extra, prefill, \
      decode = solution
  missing = []
  fixed = dict(launch_s=0.0 if np.isnan(launch) else float(launch),
               prefill_launch_s=0.0 if np.isnan(prefill_launch) else float(prefill_launch),
               idle_launch_s=0.0 if np.isnan(idle_launch) else float(idle_launch),
               per_sequence_s=0.0 if np.isnan(per_seq) else float(per_seq))

  def rate(inverse: float, name: str, fallback: float) -> float:
    if np.isnan(inverse) or inverse <= 0:
      missing.append(name)
      return fallback
    return 1.0 / inverse

  if operators is not None:
    return StepRates(
        **fixed, operators=operators,
        prefill_attention_flops=float(rate(prefill, "prefill_attention_flops",
                                           template.prefill_attention_flops)),
        decode_attention_bandwidth=float(rate(decode, "decode_attention_bandwidth",
                                              template.decode_attention_bandwidth)),
        allreduce_latency_s=template.allreduce_latency_s, link_bandwidth=template.link_bandwidth,
        source=source), tuple(missing)

  large_flops = rate(flops, "large_flops", template.regimes.large_flops)
  small_flops = (large_flops if np.isnan(flops) else 1.0 / (flops + (
      0.0 if np.isnan(extra) else extra)))
  small_bandwidth = rate(small_w, "small_bandwidth", template.regimes.small_bandwidth)
  large_bandwidth = rate(large_w, "large_bandwidth", small_bandwidth)
  decode_bandwidth = small_bandwidth if tie else rate(decode, "decode_attention_bandwidth",
                                                      template.decode_attention_bandwidth)
  return StepRates(
      **fixed, regimes=RegimeRates(knee_tokens=knee, small_flops=float(small_flops),
                          small_bandwidth=float(small_bandwidth),
                          large_flops=float(large_flops),
                          large_bandwidth=float(large_bandwidth)),
      prefill_attention_flops=float(rate(prefill, "prefill_attention_flops",
                                         template.prefill_attention_flops)),
      decode_attention_bandwidth=float(decode_bandwidth),
      allreduce_latency_s=template.allreduce_latency_s, link_bandwidth=template.link_bandwidth,
      source=source), tuple(missing)


def profile_samples(path: str | pathlib.Path, model: StepModel,
                    context: int | None) -> list[Sample]:
  """One sample per row of a per-batch profile CSV (`PROFILE_COLUMNS`, the Sarathi-Serve
  artifact's): a decode-only batch, each sequence at `context` tokens (profiles do not
  record it), or one request's whole prompt."""
  check_input_file(path, "--profile")
  try:
    with open(path, newline="") as handle:
      rows = list(csv.DictReader(handle))
  except OSError as error:
    raise ValueError(f"--profile={path}: cannot read it ({error.strerror or error})") from None
  if not rows or any(column not in rows[0] for column in PROFILE_COLUMNS):
    raise ValueError(f"--profile={path}: needs the columns {', '.join(PROFILE_COLUMNS)}")
  samples = []
  for number, row in enumerate(rows, start=2):
    try:
      tokens, prefill, decode, batch = (int(float(row[c])) for c in PROFILE_COLUMNS[:4])
      seconds = float(row["batch_execution_time"])
    except ValueError:
      raise ValueError(f"--profile={path} line {number}: not numbers") from None
    if decode and not prefill:
      if context is None:
        raise ValueError(f"--profile={path} has decode rows: give --profile_context")
      sequences = [(1, context + 1)] * batch
      label = f"decode batch {batch}"
    elif prefill and not decode and batch == 1:
      sequences = [(tokens, tokens)]
      label = f"prefill {tokens} tokens"
    else:
      raise ValueError(f"--profile={path} line {number}: only decode-only batches and "
                       "single-prompt prefills are understood")
    samples.append(Sample(model.work(sequences), seconds, label))
  return samples


def points(samples: Sequence[Sample], model: StepModel, split: str) -> list[dict[str, Any]]:
  """Measured against predicted seconds, one row per sample (`split`: train | held-out)."""
  rows = []
  for s in samples:
    predicted = model.price(s.work).seconds
    rows.append(dict(label=s.label, split=split, num_tokens=s.work.num_tokens,
                     num_sequences=s.work.num_sequences, measured_s=s.seconds,
                     predicted_s=predicted, error=predicted / s.seconds - 1.0))
  return rows


def split_held_out(samples: Sequence[Sample], *, max_decode_batch: int | None,
                   max_prefill_tokens: int | None) -> tuple[list[Sample], list[Sample]]:
  """(train, held out): decode-only steps with more sequences than `max_decode_batch`,
  and steps with prefill over `max_prefill_tokens` tokens, are held out (None: no
  limit) — to judge a fit on what it extrapolates to."""
  train, held = [], []
  for sample in samples:
    decode = sample.work.prefill_attention_flops == 0
    limit = max_decode_batch if decode else max_prefill_tokens
    size = sample.work.num_sequences if decode else sample.work.num_tokens
    (held if limit is not None and size > limit else train).append(sample)
  return train, held


def record(result: Fit, premises: dict[str, Any],
           rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """The calibration record: rates, premises (the fit's own included), every point."""
  return dict(rates=result.rates.to_dict(), premises=dict(
      premises, weighting=result.weighting, loss=result.loss,
      tied_decode_attention=result.tied_decode_attention,
      not_identified=list(result.not_identified),
      rms_relative_error=result.rms_relative_error), points=list(rows))


def save(path: str | pathlib.Path, result: Fit, premises: dict[str, Any],
         rows: Sequence[dict[str, Any]]) -> None:
  """Writes the calibration file (`record`)."""
  pathlib.Path(path).write_text(json.dumps(record(result, premises, rows), indent=1) + "\n")


def load(path: str | pathlib.Path) -> dict[str, Any]:
  """Reads a calibration file; raises ValueError naming what is wrong with it."""
  path = pathlib.Path(path)
  check_input_file(path, "calibration", MAX_CALIBRATION_BYTES)
  try:
    record = json.loads(path.read_text())
  except OSError as error:
    raise ValueError(f"calibration {path}: cannot read it ({error.strerror or error})") from None
  except json.JSONDecodeError as error:
    raise ValueError(f"calibration {path}: not JSON ({error.msg}, line {error.lineno})") from None
  if not isinstance(record, dict) or not isinstance(record.get("rates"), dict):
    raise ValueError(f"calibration {path}: no `rates` object")
  StepRates.from_dict(record["rates"], where=f"calibration {path}")  # checks every rate
  return record
