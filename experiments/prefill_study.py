r"""The chunked-prefill study: prefill-first against chunked prefill, at four chunk sizes.

  python -m experiments.prefill_study                       # the study's figures
  python -m experiments.prefill_study --scale=smoke         # under a minute, for CI
  python -m experiments.prefill_study --parts=sim --sim_setup=yi_34b_a100_pcie_tp2 \
      --workdir=workdir/prefill_study_yi34b                  # Sarathi-Serve's setup

Sarathi-Serve (Agrawal et al., OSDI'24) reports that chunking prefills — decodes
first, prompt chunks filling the rest of each step's token budget — removes the
generation stalls a whole-prompt prefill causes, cutting tail time-between-tokens, at
a TTFT cost that grows as chunks shrink, and so raises the load a server sustains
under a strict latency SLO. This study runs that comparison on kvpage:

  * **simulated**: Llama-2-13B fp16 on an 80 GB A100 (template step rates), or with
    `--sim_setup` another deployment of `experiments.sim_setups` (Yi-34B TP 2 on A100
    PCIe, calibrated on Sarathi-Serve's profiles), `none` (prefill-first)
    and `chunked` at chunk sizes 256 / 512 / 1,024 / 2,048, under two token budgets,
    on a long/short prompt mix that provokes stalls, at arrival rates up to past
    saturation, several seeds;
  * **real, small**: the tiny model on this machine's CPU, the same policies scaled
    down (chunks 32 / 64 / 128 / 256 under one budget), three seeds, every run warmed
    up (every step shape compiled) before its clock starts;
  * **quality**: on the real model, greedy tokens and logits of every chunk size against
    the unchunked prefill of the same prompt, in fp32 and bf16.

The thresholds are measured, never constants: an unloaded run of each part's workload
(served one request at a time, so its TPOT is the batch-1 decode step) gives the
median TPOT, and the TPOT p99 SLO is 2x it, the ITL p99 SLO (Sarathi's strict
time-between-tokens) 5x it (measured where a capacity is searched: not on the CPU at
smoke scale, where each probe would be a real run). A policy's capacity under an SLO
is searched, not read off the grid: from the lowest swept rate the rate doubles until
some seed's run breaks the SLO, then bisects (`claims.search_capacity`); each probe is
a sweep cell, so a rerun resumes it. A capacity the search never saw break is a lower
bound and says so.

`claims` states the published result in five parts, each "holds", "fails" or
"undecided: why", with its thresholds as premises: chunking shortens the longest stall
and lowers ITL p99 (judged at every swept rate, on every seed, paired by seed: the
record lists the rates where it holds), TTFT p99 grows as chunks shrink, and the best
chunk size's capacity exceeds prefill-first's under each SLO. Everything goes to
`--workdir`: the sweeps' rows (`sim/`, `tiny/`, and the unloaded runs), `study.json`
(the analysis, the claims, the premises), `sim_curves.png`, `tiny_curves.png`.
"""

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import flags

from configs import tiny
from experiments import claims as claims_lib
from experiments import cli, sim_setups, sweep
from experiments.sim_setups import SimSetup

_PARTS = flags.DEFINE_list("parts", ["sim", "tiny", "quality"], "Which parts to run.")
flags.FLAGS.set_default("workdir", "workdir/prefill_study")


@dataclasses.dataclass(frozen=True)
class Scale:
  """The study's size; `SCALES` holds the two the CLI offers."""

  sim_requests: int
  sim_rates: tuple[float, ...]
  sim_seeds: int
  sim_budgets: tuple[int, ...]
  tiny_requests: int
  tiny_rates: tuple[float, ...]
  quality_prompt_len: int
  quality_tokens: int
  tiny_seeds: int = 3
  tiny_capacity: bool = True  # search the tiny model's capacity (real runs: slow); the
  # SLOs (and their unloaded run) are measured only where a capacity is searched
  tiny_max_num_seqs: int | None = None  # the tiny server's running set (and its mixed
  # batch's rows); None: the config's own
  capacity_tolerance: float = 0.05  # the search's bisection stops within this fraction
  tiny_chunks: tuple[int, ...] = (32, 64, 128, 256)
  quality_chunks: tuple[int, ...] = (16, 64, 256)
  tiny_max_len: int | None = None  # the tiny model's context, and the token budget
  # (prefill-first needs a whole prompt to fit a step); None: the model's own
  tiny_long_prompt: int = 400  # the long prompts of the tiny workload's mix
  tiny_num_layers: int | None = None  # the tiny model's depth (smoke: 2, half the
  # compile time); None: the config's own
  quality_dtypes: tuple[str, ...] = ("fp32", "bf16")


SCALES = {
    "full": Scale(sim_requests=300, sim_rates=(1, 2, 3, 4, 5, 6, 8, 10), sim_seeds=3,
                  sim_budgets=(4096, 8192), tiny_requests=48, tiny_rates=(4, 16, 64),
                  quality_prompt_len=600, quality_tokens=32),
    "smoke": Scale(sim_requests=50, sim_rates=(1, 2, 3, 4), sim_seeds=1, sim_budgets=(4096,),
                   tiny_requests=16, tiny_rates=(64,), quality_prompt_len=48,
                   quality_tokens=3, tiny_capacity=False, capacity_tolerance=0.25,
                   tiny_max_num_seqs=16,
                   tiny_chunks=(64,), quality_chunks=(16,), tiny_max_len=256,
                   tiny_long_prompt=200, quality_dtypes=("fp32",), tiny_num_layers=2),
}
SIM_CHUNKS = (256, 512, 1024, 2048)
# The workload: one prompt in five is long (3,000 tokens), the rest short; outputs long
# enough that a stall lands inside many running requests' streams.
SIM_WORKLOAD = dict(prompt_len="mix:0.2:3000:200", output_len="uniform:64:256")
TINY_OUTPUT_LEN = "uniform:16:48"  # prompts: one in five long (`Scale.tiny_long_prompt`)
# Each SLO is this many times the unloaded run's median TPOT (the batch-1 decode step).
SLO_FACTORS = {"tpot_p99_s": 2.0, "itl_p99_s": 5.0}
SLO_RULE = ("TPOT p99 SLO = 2x, ITL p99 SLO = 5x (Sarathi-Serve's strict time between "
            "tokens) the median TPOT of an unloaded run: the same workload served one "
            "request at a time (max_num_seqs 1), prefill-first, seed 0, at the lowest "
            "swept rate")
SEARCH_MAX = 4.0  # the capacity search stops at this many times the highest swept rate
SEARCH_MIN = 1 / 8  # ... and at this fraction of the lowest when even that breaks
SEARCH_RULE = (f"from the lowest swept rate, double until a seed's run breaks the SLO (at "
               f"most {SEARCH_MAX:g}x the highest swept rate), then bisect; a rate meets the "
               "SLO when every seed's run does")
QUALITY_TOLERANCE = 1000 * float(np.finfo(np.float32).eps)  # fp32 logits' relative gap
FIGURES = ("output_tokens_per_s", "queue_wait_p99_s", "ttft_p50_s", "ttft_p99_s",
           "tpot_p50_s", "tpot_p99_s", "itl_p99_s", "max_stall_s", "num_rejected",
           "num_preemptions", "running_batch_mean")
LABELS = {"tpot_p99_s": "TPOT p99", "itl_p99_s": "ITL p99", "max_stall_s": "longest stall",
          "ttft_p99_s": "TTFT p99"}
POLICY_KEYS = ("scheduler.prefill_policy", "scheduler.chunk_size",
               "scheduler.max_num_batched_tokens")


def rate_text(rate: float) -> str:
  """A rate as its cell writes it (the same text for a grid point and a search probe, so
  the probe resumes the grid's run)."""
  return f"{rate:.10g}"


def policies(chunks: Sequence[int], budgets: Sequence[int]) -> list[dict[str, Any]]:
  """`none` once per budget, then `chunked` at every chunk size and budget."""
  grid = [{"scheduler.prefill_policy": "none", "scheduler.chunk_size": 0,
           "scheduler.max_num_batched_tokens": budget} for budget in budgets]
  grid += [{"scheduler.prefill_policy": "chunked", "scheduler.chunk_size": chunk,
            "scheduler.max_num_batched_tokens": budget}
           for budget in budgets for chunk in chunks if chunk <= budget]
  return grid


def policy_name(cell: dict[str, Any]) -> str:
  """A cell's policy for tables and legends, e.g. `chunk 256 / budget 4096`."""
  if cell["scheduler.prefill_policy"] == "none":
    name = "prefill-first"
  else:
    name = f"chunk {cell['scheduler.chunk_size']}"
  return f"{name} / budget {cell['scheduler.max_num_batched_tokens']}"


@dataclasses.dataclass(frozen=True)
class Part:
  """One part's grid: the base run, its policies, swept rates and seeds."""

  name: str
  config: ml_collections.ConfigDict
  policies: list[dict[str, Any]]
  rates: tuple[float, ...]
  seeds: tuple[int, ...]
  search: bool  # whether to search each policy's capacity


def sim_part(scale: Scale, setup: SimSetup) -> Part:
  """The simulated part on `setup`: its rates scaled to the device, capacity searched."""
  config = setup.get_config()
  if setup.hardware is not None:  # else the config's own device
    config.hardware = setup.hardware
  config.bench.update(dict(executor="sim", num_requests=scale.sim_requests, **SIM_WORKLOAD))
  return Part("sim", config, policies(SIM_CHUNKS, scale.sim_budgets),
              tuple(rate * setup.rate_scale for rate in scale.sim_rates),
              tuple(range(scale.sim_seeds)), search=True)


def tiny_part(scale: Scale) -> Part:
  """The real tiny model on this CPU, each run warmed up before its clock starts."""
  config = tiny.get_config()
  if scale.tiny_max_len:
    config.model.max_seq_len = scale.tiny_max_len
  if scale.tiny_num_layers:
    config.model.num_layers = scale.tiny_num_layers
  if scale.tiny_max_num_seqs:
    config.scheduler.max_num_seqs = scale.tiny_max_num_seqs
  budget = max((*scale.tiny_chunks, config.model.max_seq_len))
  config.bench.update(dict(
      executor="jax", num_requests=scale.tiny_requests, warmup=True,  # compiled first
      prompt_len=f"mix:0.2:{scale.tiny_long_prompt}:24", output_len=TINY_OUTPUT_LEN))
  return Part("tiny", config, policies(scale.tiny_chunks, (budget,)),
              tuple(float(rate) for rate in scale.tiny_rates), tuple(range(scale.tiny_seeds)),
              search=scale.tiny_capacity)


def cells(part: Part, policies_: Sequence[dict[str, Any]],
          rates: Sequence[float]) -> list[sweep.Cell]:
  """Every policy at every rate, on every seed of `part`."""
  grid = [policy | {"arrival_rate": rate_text(rate)} for policy in policies_ for rate in rates]
  return sweep.plan_cells(part.config, grid, part.seeds)


def measure_unloaded(part: Part, directory: pathlib.Path,
                     show_progress: bool) -> dict[str, Any]:
  """The unloaded run (`SLO_RULE`) and the SLOs it sets."""
  config = ml_collections.ConfigDict(part.config.to_dict())
  config.scheduler.max_num_seqs = 1
  cell = sweep.plan_cells(config, [part.policies[0] | {"arrival_rate": rate_text(
      min(part.rates))}], [0])
  (row,) = sweep.run_sweep(config, cell, directory, show_progress=show_progress)
  tpot = row["metrics"]["tpot_p50_s"]
  return dict(rule=SLO_RULE, unloaded_tpot_p50_s=tpot, arrival_rate=min(part.rates),
              slos={metric: factor * tpot for metric, factor in SLO_FACTORS.items()})


def search(part: Part, policy: dict[str, Any], metric: str, slo_s: float,
           run: Callable[[list[sweep.Cell]], list[dict]],
           tolerance: float) -> claims_lib.Capacity:
  """`policy`'s capacity under `metric` <= `slo_s` (`SEARCH_RULE`), each probe a sweep
  cell per seed run through `run`."""
  def meets(rate: float) -> bool:
    values = [row["metrics"].get(metric) for row in run(cells(part, [policy], [rate]))]
    return all(value is not None and value <= slo_s for value in values)

  return claims_lib.search_capacity(meets, min(part.rates),
                                    max_rate=SEARCH_MAX * max(part.rates),
                                    min_rate=SEARCH_MIN * min(part.rates),
                                    relative_tolerance=tolerance)


def _spread(values: list[float | None]) -> dict[str, Any]:
  present = [value for value in values if value is not None]
  return dict(by_seed=values, mean=float(np.mean(present)) if present else None,
              min=min(present, default=None), max=max(present, default=None))


def analyze(rows: Sequence[dict], part: Part, unloaded: dict[str, Any] | None,
            capacities: dict[str, dict[str, Any]], tolerance: float) -> dict[str, Any]:
  """Per policy and swept rate: each figure on every seed (in `seeds` order) with its
  mean, min and max; per policy, its capacity under each SLO (None: not searched)."""
  result: dict[str, Any] = {}
  for policy in part.policies:
    name = policy_name(policy)
    mine = [row for row in rows if policy_name(row["cell"]) == name]
    by_rate = {}
    for rate in part.rates:
      at = {row["cell"]["seed"]: row["metrics"] for row in mine
            if row["cell"]["arrival_rate"] == rate_text(rate)}
      by_rate[rate_text(rate)] = {metric: _spread([at[seed].get(metric) if seed in at else None
                                                   for seed in part.seeds])
                                  for metric in FIGURES}
    result[name] = dict(prefill_policy=policy["scheduler.prefill_policy"],
                        chunk_size=policy["scheduler.chunk_size"],
                        budget=policy["scheduler.max_num_batched_tokens"], by_rate=by_rate,
                        capacity=capacities.get(name, dict.fromkeys(SLO_FACTORS)))
  searched = dict(rule=SEARCH_RULE, start=min(part.rates), max_rate=SEARCH_MAX * max(part.rates),
                  min_rate=SEARCH_MIN * min(part.rates), tolerance=tolerance)
  return dict(seeds=list(part.seeds), rates=list(part.rates),
              slos=unloaded["slos"] if unloaded else {},
              unloaded=unloaded, search=searched if part.search else None, policies=result)


def run_part(part: Part, directory: pathlib.Path, *, tolerance: float,
             show_progress: bool = True) -> dict[str, Any]:
  """The part's unloaded run, its grid and its capacity searches into `directory`
  (resumable); its analysis, premises and claims."""
  unloaded = (measure_unloaded(part, directory / f"{part.name}_unloaded", show_progress)
              if part.search else None)
  done: dict[str, sweep.Cell] = {}

  def run(todo: list[sweep.Cell]) -> list[dict]:
    done.update((cell.cell_id, cell) for cell in todo)
    return sweep.run_sweep(part.config, todo, directory / part.name,
                           show_progress=show_progress)

  grid = run(cells(part, part.policies, part.rates))
  capacities: dict[str, dict[str, Any]] = {}
  for policy in part.policies:
    if unloaded:
      capacities[policy_name(policy)] = {
          metric: search(part, policy, metric, slo, run, tolerance).to_dict()
          for metric, slo in unloaded["slos"].items()}
  run(list(done.values()))  # every row in one table (results.csv) and one manifest
  analysis = analyze(grid, part, unloaded, capacities, tolerance)
  budgets = sorted({policy["scheduler.max_num_batched_tokens"] for policy in part.policies})
  # Real runs compile before the clock starts: any compile inside one would show here.
  compiles = sum(row["premises"].get("compiles_during_run") or 0 for row in grid)
  return dict(analysis=analysis, premises=grid[0]["premises"], compiles_during_runs=compiles,
              claims={str(budget): claims(analysis, budget) for budget in budgets})


def by_budget(analysis: dict[str, Any], budget: int) -> tuple[dict | None, dict[int, dict]]:
  """Prefill-first's figures and each chunk size's, under one token `budget`."""
  mine = [entry for entry in analysis["policies"].values() if entry["budget"] == budget]
  first = next((entry for entry in mine if entry["prefill_policy"] == "none"), None)
  return first, {entry["chunk_size"]: entry for entry in mine
                 if entry["prefill_policy"] == "chunked"}


def _per_rate(analysis: dict[str, Any],
              test: Callable[[str, int], bool | None]) -> dict[str, list[float]]:
  """The swept rates where `test(rate, seed index)` holds on every seed, fails on one,
  or cannot be judged (a figure missing)."""
  out: dict[str, list[float]] = dict(holds_at=[], fails_at=[], unknown_at=[])
  for rate in analysis["rates"]:
    results = [test(rate_text(rate), i) for i in range(len(analysis["seeds"]))]
    key = ("fails_at" if False in results else "unknown_at" if None in results
           else "holds_at")
    out[key].append(rate)
  return out


def _seed(entry: dict, rate: str, metric: str, index: int) -> float | None:
  return entry["by_rate"][rate][metric]["by_seed"][index]


def _less(a: float | None, b: float | None) -> bool | None:
  return None if a is None or b is None else a < b


def _ms(value: float | None) -> str:
  return "n/a" if value is None else f"{1e3 * value:,.0f}"


def _rates_claim(text: str, analysis: dict[str, Any], test: Callable[[str, int], bool | None],
                 evidence: str) -> dict[str, Any]:
  """A claim judged at every swept rate on every seed: it holds where it holds on every
  seed, and holds as a whole only where it holds at every rate."""
  where = _per_rate(analysis, test)
  holds = (False if where["fails_at"] else None if where["unknown_at"] or not where["holds_at"]
           else True)
  rates = lambda key: ", ".join(f"{rate:g}" for rate in where[key]) or "none"
  record = claims_lib.claim(
      text, holds, f"{evidence}; holds at {rates('holds_at')} req/s, fails at "
      f"{rates('fails_at')}", why=f"figures missing at {rates('unknown_at')} req/s",
      premises=dict(rates=analysis["rates"], seeds=analysis["seeds"],
                    rule="judged per rate, on every seed (the same workload under each "
                         "policy); holds only if it holds at every swept rate"))
  record.update(where)
  return record


def claim_below_prefill_first(analysis: dict[str, Any], budget: int,
                              metric: str) -> dict[str, Any]:
  """Every chunk size's `metric` (the longest stall, ITL p99) is below prefill-first's."""
  first, chunked = by_budget(analysis, budget)
  text = (f"chunking cuts the {LABELS[metric]}: every chunk size's is below prefill-first's, "
          f"at every swept rate (budget {budget})")
  if first is None or not chunked:
    return claims_lib.claim(text, None, "", why=f"no prefill-first and chunked pair at budget "
                            f"{budget}")

  def test(rate: str, i: int) -> bool | None:
    below = [_less(_seed(entry, rate, metric, i), _seed(first, rate, metric, i))
             for entry in chunked.values()]
    return None if None in below else all(below)

  mean = lambda entry, rate: entry["by_rate"][rate][metric]["mean"]
  evidence = f"{LABELS[metric]} (ms, mean over seeds), prefill-first vs chunk " + "/".join(
      map(str, sorted(chunked))) + ": " + "; ".join(
      f"{rate:g} req/s {_ms(mean(first, rate_text(rate)))} vs "
      + "/".join(_ms(mean(chunked[c], rate_text(rate))) for c in sorted(chunked))
      for rate in analysis["rates"])
  return _rates_claim(text, analysis, test, evidence)


def claim_ttft_cost(analysis: dict[str, Any], budget: int) -> dict[str, Any]:
  """TTFT p99 (the long prompts') at the smallest chunk exceeds that at the largest."""
  _, chunked = by_budget(analysis, budget)
  text = ("the TTFT cost grows as chunks shrink: TTFT p99 (the long prompts, one in five) at "
          f"the smallest chunk exceeds that at the largest, at every swept rate (budget "
          f"{budget})")
  if len(chunked) < 2:
    return claims_lib.claim(text, None, f"chunk sizes {sorted(chunked)}",
                            why="fewer than two chunk sizes to compare")
  small, large = chunked[min(chunked)], chunked[max(chunked)]
  test = lambda rate, i: _less(_seed(large, rate, "ttft_p99_s", i),
                               _seed(small, rate, "ttft_p99_s", i))
  mean = lambda entry, rate: entry["by_rate"][rate_text(rate)]["ttft_p99_s"]["mean"]
  evidence = (f"TTFT p99 (ms, mean over seeds), chunk {min(chunked)} vs {max(chunked)}: "
              + "; ".join(f"{rate:g} req/s {_ms(mean(small, rate))} vs {_ms(mean(large, rate))}"
                          for rate in analysis["rates"]))
  return _rates_claim(text, analysis, test, evidence)


def _bounds(capacity: dict[str, Any]) -> tuple[float, float]:
  """What a search says of the capacity: at least the first, below the second."""
  return capacity["rate"] or 0.0, capacity["broken_at"] or math.inf


def capacity_text(capacity: dict[str, Any]) -> str:
  """A searched capacity in words: the rate with where it broke, or a bound."""
  if capacity["rate"] is None:
    return f"< {capacity['broken_at']:.3g}"
  if not capacity["reached"]:
    return f">= {capacity['rate']:.3g} (never broke)"
  return f"{capacity['rate']:.3g} (breaks at {capacity['broken_at']:.3g})"


def claim_capacity(analysis: dict[str, Any], budget: int, metric: str) -> dict[str, Any]:
  """The best chunk size sustains a higher arrival rate than prefill-first under the SLO
  on `metric`: its capacity's lower end is at or past where prefill-first's broke."""
  first, chunked = by_budget(analysis, budget)
  text = (f"chunking raises capacity under a strict {LABELS[metric]} SLO: the best chunk "
          f"size sustains a higher rate than prefill-first (budget {budget})")
  if analysis["search"] is None:
    return claims_lib.claim(text, None, "", why="capacity not searched at this scale")
  slo = analysis["slos"][metric]
  premises = dict(slo_s=slo, slo_rule=analysis["unloaded"]["rule"],
                  unloaded_tpot_p50_s=analysis["unloaded"]["unloaded_tpot_p50_s"],
                  search=analysis["search"])
  if first is None or not chunked:
    return claims_lib.claim(text, None, "", why=f"no prefill-first and chunked pair at budget "
                            f"{budget}", premises=premises)
  bounds = {chunk: _bounds(entry["capacity"][metric]) for chunk, entry in chunked.items()}
  best = max(bounds, key=bounds.__getitem__)
  (low, high), (first_low, first_high) = bounds[best], _bounds(first["capacity"][metric])
  holds = True if low >= first_high else False if high <= first_low else None
  if math.isinf(high) and math.isinf(first_high):
    why = (f"every policy meets the SLO up to the search's end "
           f"({analysis['search']['max_rate']:g} req/s): the capacities are lower bounds")
  elif high == first_high and low == first_low == 0:
    why = "no policy meets the SLO even at the lowest rate searched"
  else:
    why = "the capacities overlap within the search's resolution"
  evidence = (f"{LABELS[metric]} <= {1e3 * slo:.3g} ms (req/s): prefill-first "
              f"{capacity_text(first['capacity'][metric])}; best chunk {best} "
              f"{capacity_text(chunked[best]['capacity'][metric])}; " + ", ".join(
                  f"chunk {c} {capacity_text(chunked[c]['capacity'][metric])}"
                  for c in sorted(chunked)))
  return claims_lib.claim(text, holds, evidence, why=why, premises=premises)


def claims(analysis: dict[str, Any], budget: int) -> list[dict[str, Any]]:
  """Sarathi-Serve's result in five parts under one token `budget`, each holding, failing
  or undecided: chunking (1) shortens the longest stall and (2) lowers ITL p99 at every
  rate, (3) costs TTFT p99 as chunks shrink, and raises capacity under (4) the TPOT p99
  SLO and (5) the ITL p99 SLO."""
  return [claim_below_prefill_first(analysis, budget, "max_stall_s"),
          claim_below_prefill_first(analysis, budget, "itl_p99_s"),
          claim_ttft_cost(analysis, budget),
          *(claim_capacity(analysis, budget, metric) for metric in SLO_FACTORS)]


def quality(*, prompt_len: int, num_tokens: int, chunks: Sequence[int] = (16, 64, 256),
            dtypes: Sequence[str] = ("fp32", "bf16"), seed: int = 0,
            num_layers: int | None = None) -> list[dict[str, Any]]:
  """Chunked against unchunked prefill of one prompt on the real (tiny) model, per dtype
  and chunk size: greedy token agreement over `num_tokens` tokens, and the largest logit
  difference over the generated positions while the tokens agree (so both runs see the
  same inputs), also relative to the largest logit."""
  from experiments import prefill_quality  # jax and the model: imported when used

  rows = []
  for dtype in dtypes:
    model = tiny.get_config(dtype).model
    if num_layers:
      model.num_layers = num_layers
    reference = prefill_quality.greedy_with_logits(model, prompt_len=prompt_len,
                                                   num_tokens=num_tokens, chunk_size=0,
                                                   seed=seed)
    scale = float(np.max(np.abs(reference.logits)))
    for chunk in chunks:
      run_ = prefill_quality.greedy_with_logits(model, prompt_len=prompt_len,
                                                num_tokens=num_tokens, chunk_size=chunk,
                                                seed=seed)
      agree = [a == b for a, b in zip(run_.tokens, reference.tokens, strict=True)]
      prefix = agree.index(False) if False in agree else len(agree)
      compared = max(prefix, 1)  # the first position always has the same inputs
      difference = float(np.max(np.abs(run_.logits[:compared] - reference.logits[:compared])))
      rows.append(dict(dtype=dtype, chunk_size=chunk, prompt_len=prompt_len,
                       num_tokens=num_tokens, prefill_steps=run_.num_prefill_steps,
                       token_agreement=float(np.mean(agree)), agreeing_prefix=prefix,
                       max_logit_diff=difference, max_logit_diff_relative=difference / scale))
  return rows


def claim_quality(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """In fp32, every chunk size gives the unchunked prefill's greedy tokens, and logits
  within `QUALITY_TOLERANCE` of the largest logit (chunking only reorders sums)."""
  fp32 = [row for row in rows if row["dtype"] == "fp32"]
  text = ("chunking leaves fp32 outputs unchanged: the same greedy tokens, logits within "
          "the tolerance of the unchunked prefill's")
  premises = dict(tolerance_relative=QUALITY_TOLERANCE,
                  rule="1,000 fp32 machine epsilons of the largest logit (sums reordered)")
  if not fp32:
    return claims_lib.claim(text, None, "", why="no fp32 run", premises=premises)
  holds = all(row["token_agreement"] == 1.0
              and row["max_logit_diff_relative"] <= QUALITY_TOLERANCE for row in fp32)
  evidence = "; ".join(f"chunk {row['chunk_size']}: agreement {row['token_agreement']:.0%}, "
                       f"largest logit gap {row['max_logit_diff_relative']:.1e}" for row in fp32)
  return claims_lib.claim(text, holds, evidence, premises=premises)


def run(scale: Scale, directory: pathlib.Path, parts: Sequence[str] = ("sim", "tiny", "quality"),
        *, show_progress: bool = True,
        setup: SimSetup = sim_setups.SETUPS[sim_setups.DEFAULT]) -> dict[str, Any]:
  """Runs the study's `parts` into `directory` (resumable: done runs are kept), the
  simulated part on `setup`; returns the record written to study.json."""
  record: dict[str, Any] = dict(scale=dataclasses.asdict(scale))
  if "sim" in parts:
    record["sim"] = dict(setup=setup.name, **run_part(
        sim_part(scale, setup), directory, tolerance=scale.capacity_tolerance,
        show_progress=show_progress))
  if "tiny" in parts:
    record["tiny"] = run_part(tiny_part(scale), directory, tolerance=scale.capacity_tolerance,
                              show_progress=show_progress)
  if "quality" in parts:
    rows = quality(prompt_len=scale.quality_prompt_len, num_tokens=scale.quality_tokens,
                   chunks=scale.quality_chunks, dtypes=scale.quality_dtypes,
                   num_layers=scale.tiny_num_layers)
    record["quality"] = dict(rows=rows, claim=claim_quality(rows))
  return record


PANELS = (("output_tokens_per_s", "throughput (output tokens/s)"),
          ("ttft_p50_s", "TTFT p50 (ms)"), ("ttft_p99_s", "TTFT p99 (ms)"),
          ("tpot_p99_s", "TPOT p99 (ms)"), ("itl_p99_s", "ITL p99 (ms)"),
          ("max_stall_s", "longest stall (ms)"), ("queue_wait_p99_s", "queue wait p99 (ms)"))


def figure(part: dict[str, Any], title: str) -> Any:
  """Each figure against the arrival rate, a colour per policy, mean over seeds with
  min-max bars; the SLOs on their panels with each policy's capacity (dashed, its
  colour); the capacities with their brackets; the premises in the caption."""
  import matplotlib.pyplot as plt

  from experiments import plots

  analysis = part["analysis"]
  names = list(analysis["policies"])
  colours = {name: f"C{i % 10}" for i, name in enumerate(names)}  # tab10, by policy
  spreads = lambda name, metric: [analysis["policies"][name]["by_rate"][rate_text(r)][metric]
                                  for r in analysis["rates"]]
  panels = [(metric, label) for metric, label in PANELS
            if any(f["max"] for name in names for f in spreads(name, metric))]  # no all-zero one
  searched = analysis["search"] is not None
  count = len(panels) + searched
  columns = min(4, count)
  fig, axes = plt.subplots(math.ceil(count / columns), columns, squeeze=False,
                           figsize=(4.2 * columns, 3.3 * math.ceil(count / columns)),
                           constrained_layout=True)
  flat = list(axes.flat)
  for ax, (metric, label) in zip(flat, panels, strict=False):
    scale = 1.0 if metric.endswith("per_s") else 1e3
    for index, name in enumerate(names):
      # The policies' bars side by side, within 3% of the rate either way.
      dodge = 1 + 0.06 * (index / max(1, len(names) - 1) - 0.5)
      figures = spreads(name, metric)
      present = [(r, f) for r, f in zip(analysis["rates"], figures, strict=True)
                 if f["mean"] is not None]
      ax.errorbar([dodge * r for r, _ in present], [scale * f["mean"] for _, f in present],
                  yerr=[[scale * (f["mean"] - f["min"]) for _, f in present],
                        [scale * (f["max"] - f["mean"]) for _, f in present]],
                  marker="o", ms=3, capsize=2, lw=1, color=colours[name], label=name)
    if metric in analysis["slos"]:
      plots.threshold(ax, scale * analysis["slos"][metric],
                      f"SLO {scale * analysis['slos'][metric]:.3g} ms")
      for name in names if searched else ():
        capacity = analysis["policies"][name]["capacity"][metric]
        if capacity["rate"] is not None and capacity["rate"] <= max(analysis["rates"]):
          plots.threshold(ax, capacity["rate"], "", vertical=True, color=colours[name])
    ax.set(xlabel="arrival rate (req/s)", ylabel=label, xlim=(0, 1.1 * max(analysis["rates"])))
    ax.grid(alpha=0.3)
  if searched:  # each policy's capacity under each SLO: where it met it, where it broke
    ax = flat[len(panels)]
    ends = []
    for row, name in enumerate(names):
      for offset, (metric, marker) in zip((-0.15, 0.15), zip(SLO_FACTORS, "os"), strict=True):
        capacity = analysis["policies"][name]["capacity"][metric]
        low, high = _bounds(capacity)
        high = min(high, analysis["search"]["max_rate"])
        ends.append(high)
        ax.plot([low, high], [row + offset] * 2, color=colours[name], lw=3, alpha=0.4)
        ax.plot([low], [row + offset], marker=marker if capacity["reached"] else ">",
                color=colours[name], ls="")
        ax.annotate(f"{low:.3g}", (low, row + offset), fontsize=6, va="center",
                    xytext=(-4, 0), textcoords="offset points", ha="right")
    if any(not entry["capacity"][metric]["reached"] for entry in analysis["policies"].values()
           for metric in SLO_FACTORS):
      plots.threshold(ax, analysis["search"]["max_rate"], "search end", vertical=True)
    ax.set_yticks(range(len(names)), names, fontsize=6)
    ax.set(xlim=(0, 1.1 * max(ends)), title="capacity under each SLO",
           xlabel="capacity (req/s): o TPOT SLO, s ITL SLO, > never broke;\n"
                  "band: from the highest rate that met it to the lowest that broke it")
    ax.xaxis.label.set_fontsize(7)
    ax.grid(alpha=0.3)
  for ax in flat[count:]:
    ax.set_visible(False)
  plots.legend_outside(flat[min(columns, count) - 1])
  slos = ", ".join(f"{LABELS[m]} {_ms(v)} ms" for m, v in analysis["slos"].items())
  premises = plots.premises_line(part["premises"], (*POLICY_KEYS, "arrival_rate", "seed"))
  thresholds = (f"SLOs {slos} (dashed black; dashed in a policy's colour: its capacity, "
                f"labelled in the last panel):\n{SLO_RULE}\ncapacity: {SEARCH_RULE}"
                if searched else "capacity not searched at this scale (no SLO measured)")
  fig.suptitle(f"{title}\n{premises}\nmean over seeds {analysis['seeds']}, bars: min-max "
               f"(points dodged apart); {thresholds}", fontsize=7)
  return fig


def format_report(record: dict[str, Any]) -> str:
  lines = []
  for part in ("sim", "tiny"):
    if part not in record:
      continue
    analysis = record[part]["analysis"]
    lines.append(f"{part}: " + (
        f"SLOs TPOT p99 <= {_ms(analysis['slos']['tpot_p99_s'])} ms, ITL p99 <= "
        f"{_ms(analysis['slos']['itl_p99_s'])} ms ({SLO_RULE}); unloaded median TPOT "
        f"{_ms(analysis['unloaded']['unloaded_tpot_p50_s'])} ms" if analysis["unloaded"]
        else "capacity not searched at this scale (no SLO measured)"))
    top = rate_text(max(analysis["rates"]))
    for policy, entry in analysis["policies"].items():
      at = {metric: figure["mean"] for metric, figure in entry["by_rate"][top].items()}
      capacity = " / ".join("n/a" if entry["capacity"][m] is None
                            else capacity_text(entry["capacity"][m]) for m in SLO_FACTORS)
      lines.append(f"  {policy:<26} capacity TPOT / ITL {capacity}; at {top} req/s: "
                   f"{at['output_tokens_per_s']:,.0f} tok/s, TTFT p99 {_ms(at['ttft_p99_s'])} "
                   f"ms, TPOT p99 {_ms(at['tpot_p99_s'])} ms, stall {_ms(at['max_stall_s'])} ms")
    for stated in record[part]["claims"].values():
      lines += [f"  [{claim['verdict']}] {claim['claim']}: {claim['evidence']}"
                for claim in stated]
  if "quality" in record:
    claim = record["quality"]["claim"]
    lines.append(f"quality: [{claim['verdict']}] {claim['claim']}: {claim['evidence']}")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  unknown = set(_PARTS.value) - {"sim", "tiny", "quality"}
  if unknown:
    raise ValueError(f"--parts: unknown {sorted(unknown)}; choose from sim, tiny, quality")
  from experiments import plots  # fails now, not after the runs, without matplotlib

  with cli.workdir(flags.FLAGS.workdir) as directory:
    cli.enable_compilation_cache(flags.FLAGS.compilation_cache)
    record = run(SCALES[sim_setups.SCALE.value], directory, _PARTS.value,
                 setup=sim_setups.SETUPS[sim_setups.SETUP.value])
    titles = dict(sim=f"chunked prefill study: simulated, {sim_setups.SETUP.value}",
                  tiny="chunked prefill study: the tiny model on this CPU")
    for part in ("sim", "tiny"):
      if part in record:
        plots.save(figure(record[part], titles[part]), directory / f"{part}_curves.png")
    cli.write_files(directory, {"study.json": json.dumps(record, indent=2)})
  print(format_report(record))
  print(f"\nwrote {directory}/study.json and the figures")


if __name__ == "__main__":
  cli.run(main)
