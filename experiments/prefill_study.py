r"""The chunked-prefill study: prefill-first against chunked prefill, at four chunk sizes.

  python -m experiments.prefill_study                       # the study's figures
  python -m experiments.prefill_study --scale=smoke         # a minute, for CI
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
    down (chunks 32 / 64 / 128 / 256 under one budget), one seed;
  * **quality**: on the real model, greedy tokens and logits of every chunk size against
    the unchunked prefill of the same prompt, in fp32 and bf16.

Reported per policy: throughput, queue wait, TTFT p50/p99, TPOT p99, ITL p99 and the
longest generation stall (the largest gap between two tokens of one request), and the
capacity under a TPOT p99 SLO (the highest swept rate whose mean over seeds meets it;
also under an ITL p99 SLO, Sarathi's time-between-tokens). `claims` states the
published result's three parts from the numbers, each true or false. Everything goes
to `--workdir`: the sweeps' rows, `study.json` (the analysis, the claims, the
premises), `sim_curves.png`, `tiny_curves.png`.
"""

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import flags

from configs import tiny
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
  tiny_chunks: tuple[int, ...] = (32, 64, 128, 256)
  quality_chunks: tuple[int, ...] = (16, 64, 256)
  tiny_warmup: bool = True  # compile every step shape before the clock starts
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
    "smoke": Scale(sim_requests=100, sim_rates=(1, 2, 3, 4), sim_seeds=1, sim_budgets=(4096,),
                   tiny_requests=8, tiny_rates=(8,), quality_prompt_len=48,
                   quality_tokens=3, tiny_chunks=(64,), quality_chunks=(16,),
                   tiny_warmup=False,  # smoke: compiles inside the (reported-only) run
                   tiny_max_len=256, tiny_long_prompt=200, quality_dtypes=("fp32",),
                   tiny_num_layers=2),
}
SIM_CHUNKS = (256, 512, 1024, 2048)
# The workload: one prompt in five is long (3,000 tokens), the rest short; outputs long
# enough that a stall lands inside many running requests' streams.
SIM_WORKLOAD = dict(prompt_len="mix:0.2:3000:200", output_len="uniform:64:256")
TINY_OUTPUT_LEN = "uniform:16:48"  # prompts: one in five long (`Scale.tiny_long_prompt`)
TINY_TPOT_SLO_S = 0.05  # the simulated setups' SLOs are theirs (`sim_setups`)
TINY_ITL_SLO_S = 0.1


def policies(chunks: Sequence[int], budgets: Sequence[int]) -> list[dict[str, Any]]:
  """`none` once per budget, then `chunked` at every chunk size and budget."""
  grid = [{"scheduler.prefill_policy": "none", "scheduler.chunk_size": 0,
           "scheduler.max_num_batched_tokens": budget} for budget in budgets]
  grid += [{"scheduler.prefill_policy": "chunked", "scheduler.chunk_size": chunk,
            "scheduler.max_num_batched_tokens": budget}
           for budget in budgets for chunk in chunks if chunk <= budget]
  return grid


def policy_name(cell: dict[str, Any]) -> str:
  if cell["scheduler.prefill_policy"] == "none":
    name = "prefill-first"
  else:
    name = f"chunk {cell['scheduler.chunk_size']}"
  return f"{name} / budget {cell['scheduler.max_num_batched_tokens']}"


def sim_cells(scale: Scale, setup: SimSetup) -> tuple[ml_collections.ConfigDict,
                                                      list[sweep.Cell]]:
  config = setup.get_config()
  if setup.hardware is not None:  # else the config's own device
    config.hardware = setup.hardware
  config.bench.update(dict(executor="sim", num_requests=scale.sim_requests, **SIM_WORKLOAD))
  grid = [policy | {"arrival_rate": f"{rate * setup.rate_scale:g}"}
          for policy in policies(SIM_CHUNKS, scale.sim_budgets) for rate in scale.sim_rates]
  return config, sweep.plan_cells(config, grid, range(scale.sim_seeds))


def tiny_cells(scale: Scale) -> tuple[ml_collections.ConfigDict, list[sweep.Cell]]:
  config = tiny.get_config()
  if scale.tiny_max_len:
    config.model.max_seq_len = scale.tiny_max_len
  if scale.tiny_num_layers:
    config.model.num_layers = scale.tiny_num_layers
  budget = max((*scale.tiny_chunks, config.model.max_seq_len))
  config.bench.update(dict(
      executor="jax", num_requests=scale.tiny_requests, warmup=scale.tiny_warmup,
      prompt_len=f"mix:0.2:{scale.tiny_long_prompt}:24", output_len=TINY_OUTPUT_LEN))
  grid = [policy | {"arrival_rate": str(rate)}
          for policy in policies(scale.tiny_chunks, (budget,)) for rate in scale.tiny_rates]
  return config, sweep.plan_cells(config, grid, [0])


def by_policy(rows: Sequence[dict]) -> dict[str, dict[float, list[dict]]]:
  """Rows grouped by policy, then by arrival rate."""
  grouped: dict[str, dict[float, list[dict]]] = {}
  for row in rows:
    rate = float(row["cell"]["arrival_rate"])
    grouped.setdefault(policy_name(row["cell"]), {}).setdefault(rate, []).append(row)
  return grouped


def _mean(rows: Sequence[dict], metric: str) -> float | None:
  # .get: rows resumed from before a figure was recorded lack it.
  values = [row["metrics"][metric] for row in rows if row["metrics"].get(metric) is not None]
  return float(np.mean(values)) if values else None


def capacity(by_rate: dict[float, list[dict]], metric: str, slo_s: float) -> float | None:
  """The highest swept rate whose mean `metric` over seeds meets `slo_s` with every rate
  below meeting it too (a capacity, not a lucky point past a failure); None if none."""
  best = None
  for rate in sorted(by_rate):
    value = _mean(by_rate[rate], metric)
    if value is None or value > slo_s:
      break
    best = rate
  return best


def analyze(rows: Sequence[dict], tpot_slo_s: float, itl_slo_s: float) -> dict[str, Any]:
  """Per policy: the mean figures at every rate, and the capacities under the SLOs."""
  figures = ("output_tokens_per_s", "queue_wait_p99_s", "ttft_p50_s", "ttft_p99_s",
             "tpot_p99_s", "itl_p99_s", "max_stall_s", "num_rejected", "num_preemptions",
             "running_batch_mean")
  result = {}
  for policy, by_rate in by_policy(rows).items():
    result[policy] = dict(
        by_rate={str(rate): {metric: _mean(group, metric) for metric in figures}
                 for rate, group in sorted(by_rate.items())},
        capacity_tpot_p99=capacity(by_rate, "tpot_p99_s", tpot_slo_s),
        capacity_itl_p99=capacity(by_rate, "itl_p99_s", itl_slo_s))
  return dict(policies=result, tpot_slo_s=tpot_slo_s, itl_slo_s=itl_slo_s)


def claims(analysis: dict[str, Any], budget: int) -> list[dict[str, Any]]:
  """Sarathi-Serve's result in three parts, each stated from the numbers, true or false.

  Compared under one token `budget`, at the highest rate every policy ran: (1) every
  chunk size has a shorter longest stall and a lower ITL p99 than prefill-first; (2)
  TTFT p99 — the long prompts' — grows as chunks shrink (smallest chunk > largest); (3)
  the capacity under the TPOT p99 SLO of the best chunk size exceeds prefill-first's;
  (4) so does its capacity under the ITL p99 SLO (Sarathi-Serve's own measure: P99
  time between tokens).
  """
  policies_ = {name: figures for name, figures in analysis["policies"].items()
               if name.endswith(f"/ budget {budget}")}
  first = policies_.get(f"prefill-first / budget {budget}")
  chunked = {int(name.split()[1]): figures for name, figures in policies_.items()
             if name.startswith("chunk ")}
  if first is None or not chunked:
    return []
  rate = max(first["by_rate"], key=float)
  at = lambda figures, metric: figures["by_rate"][rate][metric]
  stalls = {chunk: at(figures, "max_stall_s") for chunk, figures in chunked.items()}
  itl = {chunk: at(figures, "itl_p99_s") for chunk, figures in chunked.items()}
  smallest, largest = min(chunked), max(chunked)
  ttft_small, ttft_large = at(chunked[smallest], "ttft_p99_s"), at(chunked[largest], "ttft_p99_s")
  ms = lambda value: "n/a" if value is None else f"{1e3 * value:.0f} ms"
  return [
      dict(claim="chunking removes prefill stalls: every chunk size has a shorter longest "
                 "stall and a lower ITL p99 than prefill-first",
           holds=all(stalls[c] < at(first, "max_stall_s") and itl[c] < at(first, "itl_p99_s")
                     for c in chunked),
           evidence=f"at {rate} req/s: longest stall {ms(at(first, 'max_stall_s'))} "
                    f"prefill-first vs " + ", ".join(f"{ms(stalls[c])} chunk {c}"
                                                     for c in sorted(chunked))
                    + f"; ITL p99 {ms(at(first, 'itl_p99_s'))} vs "
                    + ", ".join(f"{ms(itl[c])}" for c in sorted(chunked))),
      dict(claim="the TTFT cost grows as chunks shrink: TTFT p99 (the long prompts, one in "
                 "five) at the smallest chunk exceeds TTFT p99 at the largest",
           holds=ttft_small is not None and ttft_large is not None and ttft_small > ttft_large,
           evidence=f"at {rate} req/s: TTFT p99 " + ", ".join(
               f"{ms(at(chunked[c], 'ttft_p99_s'))} chunk {c}" for c in sorted(chunked))
                    + f", {ms(at(first, 'ttft_p99_s'))} prefill-first; TTFT p50 (short "
                    "prompts) " + ", ".join(f"{ms(at(chunked[c], 'ttft_p50_s'))} chunk {c}"
                                            for c in sorted(chunked))
                    + f", {ms(at(first, 'ttft_p50_s'))} prefill-first"),
      capacity_claim("TPOT p99", "capacity_tpot_p99", analysis["tpot_slo_s"], first, chunked),
      capacity_claim("ITL p99", "capacity_itl_p99", analysis["itl_slo_s"], first, chunked),
  ]


def capacity_claim(metric: str, key: str, slo_s: float, first: dict[str, Any],
                   chunked: dict[int, dict[str, Any]]) -> dict[str, Any]:
  """Whether the best chunk size sustains a higher rate than prefill-first under an SLO."""
  capacities = {chunk: figures[key] or 0.0 for chunk, figures in chunked.items()}
  best = max(capacities, key=capacities.get)
  first_capacity = first[key] or 0.0
  return dict(claim=f"chunking raises capacity under a strict {metric} SLO",
              holds=capacities[best] > first_capacity,
              evidence=f"{metric} <= {1e3 * slo_s:.0f} ms: prefill-first sustains "
                       f"{first_capacity:g} req/s, chunk {best} {capacities[best]:g} req/s ("
                       + ", ".join(f"chunk {c}: {capacities[c]:g}" for c in sorted(chunked))
                       + ")")


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


def run(scale: Scale, directory: pathlib.Path, parts: Sequence[str] = ("sim", "tiny", "quality"),
        *, show_progress: bool = True,
        setup: SimSetup = sim_setups.SETUPS[sim_setups.DEFAULT]) -> dict[str, Any]:
  """Runs the study's `parts` into `directory` (resumable: done runs are kept), the
  simulated part on `setup`; returns the record written to study.json."""
  record: dict[str, Any] = dict(scale=dataclasses.asdict(scale))
  if "sim" in parts:
    config, cells = sim_cells(scale, setup)
    rows = sweep.run_sweep(config, cells, directory / "sim",
                           show_progress=show_progress)
    analysis = analyze(rows, setup.tpot_slo_s, setup.itl_slo_s)
    record["sim"] = dict(analysis=analysis, premises=rows[0]["premises"], setup=setup.name,
                         claims={str(b): claims(analysis, b) for b in scale.sim_budgets})
    record["sim_rows"] = rows
  if "tiny" in parts:
    config, cells = tiny_cells(scale)
    rows = sweep.run_sweep(config, cells, directory / "tiny",
                           show_progress=show_progress)
    analysis = analyze(rows, TINY_TPOT_SLO_S, TINY_ITL_SLO_S)
    budget = cells[0].values["scheduler.max_num_batched_tokens"]
    record["tiny"] = dict(analysis=analysis, premises=rows[0]["premises"],
                          claims={str(budget): claims(analysis, budget)})
    record["tiny_rows"] = rows
  if "quality" in parts:
    record["quality"] = quality(prompt_len=scale.quality_prompt_len,
                                num_tokens=scale.quality_tokens, chunks=scale.quality_chunks,
                                dtypes=scale.quality_dtypes, num_layers=scale.tiny_num_layers)
  return record


def curves(rows: Sequence[dict], title: str):
  from experiments import plots

  named = [dict(row, cell={"policy": policy_name(row["cell"]),
                           "arrival_rate": float(row["cell"]["arrival_rate"]),
                           "seed": row["cell"]["seed"]}) for row in rows]
  swept = ("prefill_policy", "chunk_size", "max_num_batched_tokens", "arrival_rate", "seed")
  return plots.sweep_curves(named, x="arrival_rate", title=title, swept=swept, metrics=(
      "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "itl_p99_s",
      "max_stall_s", "queue_wait_p99_s", "num_rejected", "num_preemptions"))


def _batch(figures: dict[str, Any]) -> str:
  """The mean running batch (sequences per step, weighted by time), n/a if unrecorded."""
  mean = figures.get("running_batch_mean")
  return "n/a" if mean is None else f"{mean:,.1f}"


def format_report(record: dict[str, Any]) -> str:
  lines = []
  for part in ("sim", "tiny"):
    if part not in record:
      continue
    analysis = record[part]["analysis"]
    lines.append(f"{part}: capacity under TPOT p99 <= {1e3 * analysis['tpot_slo_s']:.0f} ms "
                 f"/ ITL p99 <= {1e3 * analysis['itl_slo_s']:.0f} ms (req/s)")
    for policy, figures in analysis["policies"].items():
      top = max(figures["by_rate"], key=float)
      at = figures["by_rate"][top]
      lines.append(
          f"  {policy:<26} {figures['capacity_tpot_p99']!s:>6} / "
          f"{figures['capacity_itl_p99']!s:<6} at {top} req/s: "
          f"{at['output_tokens_per_s']:,.0f} tok/s, batch {_batch(at)}, "
          f"TTFT p50 {1e3 * at['ttft_p50_s']:,.0f} ms, "
          f"TPOT p99 {1e3 * at['tpot_p99_s']:.1f} ms, stall {1e3 * at['max_stall_s']:,.0f} ms")
    for budget, stated in record[part]["claims"].items():
      for claim in stated:
        lines.append(f"  [{'holds' if claim['holds'] else 'FAILS'}] (budget {budget}) "
                     f"{claim['claim']}: {claim['evidence']}")
  for row in record.get("quality", []):
    lines.append(f"quality {row['dtype']} chunk {row['chunk_size']}: greedy agreement "
                 f"{row['token_agreement']:.0%} over {row['num_tokens']} tokens, max logit "
                 f"diff {row['max_logit_diff']:.2e} ({row['max_logit_diff_relative']:.1e} of "
                 "the largest logit)")
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
    titles = dict(sim=f"chunked prefill study: sim, {sim_setups.SETUP.value}", tiny="chunked "
                  "prefill study: tiny")
    for part in ("sim", "tiny"):
      if part in record:
        plots.save(curves(record.pop(f"{part}_rows"), titles[part]),
                   directory / f"{part}_curves.png")
    cli.write_files(directory, {"study.json": json.dumps(record, indent=2)})
  print(format_report(record))
  print(f"\nwrote {directory}/study.json and the figures")


if __name__ == "__main__":
  cli.run(main)
