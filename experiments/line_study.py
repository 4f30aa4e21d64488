r"""The line study: when concurrency rises, which admission line do you hold first?

  python -m experiments.line_study                          # Llama-2-13B on an A100
  python -m experiments.line_study --scale=smoke            # a minute, for CI
  python -m experiments.line_study --sim_setup=yi_34b_a100_pcie_tp2 \
      --workdir=workdir/line_study_yi34b                     # calibrated Yi-34B TP 2

The same traffic runs through kvpage's engine (simulated, `experiments.sim_setups`)
under each admission line an operator could hold, each swept over its own knob:

  * `none`: no line (vLLM before v0.29: every request queues);
  * `rate`: a requests/s token bucket, an API gateway's rate limit (burst: one second);
  * `concurrency`: admitted, unfinished requests (TGI's `max_concurrent_requests`);
  * `queue`: the waiting-queue bound alone (vLLM's `--max-num-queued-reqs`);
  * `tokens`: prompt + expected output tokens in flight;
  * `kv`: kvpage's KV watermark (free pages kept after the request's estimate);
  * `wait`: the forecast time to first token, against the TTFT SLO (a prompt too long
    to meet the line even on an idle engine is held to twice its idle time instead,
    `kvpage.host.scheduler.IDLE_ALLOWANCE`: refusing it on every try is no line);
  * `slowdown`: the forecast time to first token, against S x the request's own on an
    idle engine (a relative line: no SLO, no seconds to tune per deployment);
  * `kv+wait`: both, since memory and compute saturate at different loads; tuned
    coordinate-wise, as fairly as each line alone: the watermark the KV line does best
    with at that traffic and load, then swept over the wait;
  * `shipped`: what `experiments.serve` holds out of the box: the scheduler config's
    admission defaults (`max_waiting`) with a forecast-TTFT line at `SHIPPED_WAIT` x the
    strictest TTFT SLO (the wait line's usual best: see there) and the KV watermark,
    swept: so the study says which watermark to ship (`server.watermark`, 0.4 from this
    sweep); its claims read the line at the shipped one.

Traffic: a long/short mix (`mix:0.1:8000:50`: one prompt in ten is 8,000 tokens) and
a ShareGPT-like lognormal, steady (Poisson) and bursty (gamma, CV 3), at 1x, 2x, 5x
and 10x each mix's sustainable rate (requests/s finished with everything offered at
once and no line). Clients ask for `max_tokens` 1,024 and use 32-512. The model's
context is raised to 16,384 tokens so that the long prompts fit (the simulator prices
steps by length and runs no weights; a premise in `study.json`).

The thresholds are premises, each chosen by a rule from a measurement, never a
constant: from an unloaded run of each mix (0.05x its sustainable rate), the TTFT SLO
is 3x that run's TTFT p99 and the TPOT SLO 3x its median TPOT. Every knob's grid is
set once per setup, in absolute units, from the ShareGPT-like mix's sustainable rate
and the KV pool, so the same values meet every mix: how far a line's best value moves
between mixes is its robustness (a line that must be retuned for each mix is a worse
line).

Reported per cell (mix, arrivals, load, line at its best setting over its knob, by
mean goodput over seeds): goodput under both SLOs (rejected requests count against it,
as in arXiv 2410.14257), preemptions and recomputed prefill tokens, running requests
that failed, TTFT and TPOT p99, rejections by status. Goodput counts requests, so a line
that refuses one 8,000-token prompt to serve many 50-token ones scores well: each cell
also weighs it by prompt tokens (the share of offered prompt tokens served within both
SLOs, with each line's best knob for that measure) and splits it by prompt length.
`claims` states which line wins where and by how much, in requests and in tokens (within
`TIE` is a tie); a claim the grid cannot decide says so (`undecided: why`).
Everything goes to `--workdir`, resumably: the sweep's rows, `study.json`, and the
figures `lines_at_5x.png` and `goodput_by_load.png`.
"""

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence, Set
from typing import Any

import numpy as np
from absl import flags

from configs import base as base_config
from configs import scheduler as scheduler_config
from experiments import claims, cli, sim_setups, sweep
from experiments.sim_setups import SimSetup
from kvpage import metrics

flags.FLAGS.set_default("workdir", "workdir/line_study")

MIXES = {"long/short": "mix:0.1:8000:50", "sharegpt": "lognormal:512:3000"}
ARRIVALS = {"steady": "poisson", "bursty": "gamma:3"}
OUTPUT = dict(output_len="uniform:32:512", max_tokens=1024)
CONTEXT = 16384  # the study's model context: the long prompts must fit
LINES = ("none", "rate", "concurrency", "queue", "tokens", "kv", "wait", "slowdown",
         "kv+wait", "shipped")
# The server's forecast-TTFT line, x the TTFT SLO: in the 24 overloaded cells of the 13B
# and Yi-34B studies, the wait line alone does best at 0.1-1x the strictest mix's SLO,
# and 0.25x is its best or within `TIE` of it in 14 (0.5x: in 8).
SHIPPED_WAIT = 0.25
SHIPPED = scheduler_config.get_scheduler_config()  # admission defaults as shipped
SHIPPED_WATERMARK = base_config.server_defaults().watermark  # the server's KV line
UNLOADED = 0.05  # the unloaded run's load, x the throughput with everything at once
SLO_FACTOR = 3.0  # each SLO is this many times the unloaded run's figure
ATTAINMENT = 0.9  # sustainable: this share of requests within both SLOs, with no line
SEARCH_REACH = 8.0  # the capacity search stops at this many times the throughput
FIGURES = ("goodput_requests_per_s", "goodput_fraction", "goodput_token_fraction",
           "num_preemptions", "recomputed_tokens", "num_aborted", "ttft_p99_s", "tpot_p99_s",
           "rejected_400", "rejected_429", "rejected_503", "num_finished")
# Each prompt-length class's share of requests within both SLOs: (class, metric name).
CLASSES = tuple((name, f"goodput_fraction_prompt_{key}")
                for name, key in metrics.PROMPT_CLASS_KEYS.items())
KV_LINES = ("kv", "kv+wait", "shipped")  # the lines that hold the KV watermark
TIE = 0.05  # goodputs within this share of each other are not told apart by a claim


@dataclasses.dataclass(frozen=True)
class Scale:
  """The study's size; `SCALES` holds the two the CLI offers."""

  num_requests: int
  seeds: int
  mixes: tuple[str, ...]
  arrivals: tuple[str, ...]
  loads: tuple[float, ...]
  knobs: int  # values per line's knob to start with (the middle of its ladder)
  extend: bool  # extend each line's sweep along its ladder until its optimum is bracketed
  tolerance: float  # the capacity search's bracket, relative


SCALES = {
    "full": Scale(num_requests=600, seeds=3, mixes=tuple(MIXES), arrivals=tuple(ARRIVALS),
                  loads=(1, 2, 5, 10), knobs=5, extend=True, tolerance=0.05),
    "smoke": Scale(num_requests=150, seeds=1, mixes=tuple(MIXES), arrivals=("steady",),
                   loads=(1, 5), knobs=2, extend=False, tolerance=0.15),
}
# Every line's keys, so that each cell sets them all and its line can be read back.
WATERMARKS = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
LINE_KEYS = {"scheduler.admission": "queue_only", "scheduler.max_waiting": 0,
             "scheduler.watermark": 0.0, "scheduler.rate_limit": 0.0,
             "scheduler.rate_burst": 1, "scheduler.max_concurrent": 0,
             "scheduler.max_inflight_tokens": 0, "scheduler.max_forecast_ttft_s": 0.0,
             "scheduler.max_ttft_slowdown": 0.0}


def base(scale: Scale, setup: SimSetup) -> Any:
  """The study's base run: the setup's config, simulated, the context raised, no line."""
  config = setup.get_config()
  if setup.hardware is not None:
    config.hardware = setup.hardware
  config.model.max_seq_len = max(config.model.max_seq_len, CONTEXT)
  config.bench.update(dict(executor="sim", num_requests=scale.num_requests, **OUTPUT))
  for key, value in LINE_KEYS.items():
    config.scheduler[key.split(".")[1]] = value
  return config


def _probe(config: Any, values: dict[str, Any], directory: pathlib.Path,
           show_progress: bool) -> dict[str, Any]:
  """One measurement run: `values` (serve_bench flags) over the base `config`, a sweep
  cell kept in `directory`, so a resumed study finds it done."""
  (cell,) = sweep.plan_cells(config, [{**LINE_KEYS, **values}], [0])
  (row,) = sweep.run_cells([cell], directory, show_progress=show_progress)
  return row["summary"]


def measure(scale: Scale, setup: SimSetup, directory: pathlib.Path,
            show_progress: bool = False) -> dict[str, Any]:
  """Per mix, with no line: the throughput with everything offered at once; the SLOs,
  from an unloaded run at `UNLOADED` x that throughput; the sustainable rate, found by
  search (the highest Poisson rate at which `ATTAINMENT` of requests meet both SLOs);
  and the KV pool's tokens. Every run is a cell in `directory`."""
  config = base(scale, setup)
  sweep.claim_workdir(directory, config, [])  # the probes' base: a resumed study must share it
  measured: dict[str, Any] = {}
  for mix in scale.mixes:
    probe = lambda **values: _probe(config, dict(prompt_len=MIXES[mix], **values),  # noqa: B023
                                    directory, show_progress)
    saturated = probe(arrival_rate="inf")
    throughput = saturated["num_finished"] / saturated["duration_s"]
    unloaded = probe(arrival_process="poisson", arrival_rate=f"{UNLOADED * throughput:.4g}",
                     num_requests=max(40, scale.num_requests // 5))
    slos = dict(slo_ttft=round(SLO_FACTOR * unloaded["ttft_s"]["p99"], 4),
                slo_tpot=round(SLO_FACTOR * unloaded["tpot_s"]["p50"], 4))

    def meets(rate: float) -> bool:
      summary = probe(arrival_process="poisson", arrival_rate=f"{rate:.4g}", **slos)  # noqa: B023
      return summary["goodput_fraction"] >= ATTAINMENT

    found = claims.search_capacity(meets, throughput, max_rate=SEARCH_REACH * throughput,
                                   min_rate=UNLOADED * throughput,
                                   relative_tolerance=scale.tolerance)
    measured[mix] = dict(
        throughput_at_once=throughput, unloaded_rate=UNLOADED * throughput,
        unloaded_ttft_p99_s=unloaded["ttft_s"]["p99"],
        unloaded_tpot_p50_s=unloaded["tpot_s"]["p50"],
        slo_ttft_s=slos["slo_ttft"], slo_tpot_s=slos["slo_tpot"],
        sustainable_requests_per_s=found.rate or UNLOADED * throughput,
        capacity_search=found.to_dict(),
        pool_tokens=saturated["pages_total"] * saturated["premises"]["page_size"])
  return measured


def ladders(measured: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
  """Each line's settings (config key -> value) in knob order, in absolute units shared
  by every mix: rates around the ShareGPT-like mix's sustainable rate, token budgets
  around the KV pool, waits around the TTFT SLO of the strictest mix. A sweep starts in
  the middle of its ladder and may extend along it (`Scale.extend`)."""
  reference = measured.get("sharegpt") or next(iter(measured.values()))
  rate, pool = reference["sustainable_requests_per_s"], reference["pool_tokens"]
  slo_ttft = min(m["slo_ttft_s"] for m in measured.values())
  waits = [round(f * slo_ttft, 4) for f in (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)]
  return {
      "none": [{}],
      "rate": [{"scheduler.rate_limit": round(f * rate, 4),
                "scheduler.rate_burst": max(1, math.ceil(f * rate))}
               for f in (0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)],
      "concurrency": [{"scheduler.max_concurrent": n}
                      for n in (4, 8, 16, 32, 64, 128, 256, 512)],
      "queue": [{"scheduler.max_waiting": n} for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)],
      "tokens": [{"scheduler.max_inflight_tokens": int(f * pool)}
                 for f in (0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)],
      "kv": [{"scheduler.admission": "watermark", "scheduler.watermark": w}
             for w in WATERMARKS],
      "wait": [{"scheduler.max_forecast_ttft_s": wait} for wait in waits],
      "slowdown": [{"scheduler.max_ttft_slowdown": s}
                   for s in (1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)],
      # The watermark: the KV line's best at the cell's traffic and load (`cells`).
      "kv+wait": [{"scheduler.admission": "watermark", "scheduler.watermark": 0.15,
                   "scheduler.max_forecast_ttft_s": wait} for wait in waits],
      "shipped": [{"scheduler.admission": SHIPPED.admission,
                   "scheduler.max_waiting": SHIPPED.max_waiting,
                   "scheduler.watermark": w,
                   "scheduler.max_forecast_ttft_s": round(SHIPPED_WAIT * slo_ttft, 4)}
                  for w in WATERMARKS],
  }


def first_knobs(scale: Scale, ladder: Sequence[Any]) -> list[int]:
  """The positions a line's sweep starts with: the middle `scale.knobs` of its ladder."""
  count = min(scale.knobs, len(ladder))
  start = (len(ladder) - count) // 2
  return list(range(start, start + count))


def knob_grid(scale: Scale, measured: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
  """Each line's starting settings (see `ladders`)."""
  return {line: [ladder[i] for i in first_knobs(scale, ladder)]
          for line, ladder in ladders(measured).items()}


def line_of(cell: dict[str, Any]) -> tuple[str, Any]:
  """The line a cell holds and its knob's value, read back from the cell's keys."""
  wait = cell["scheduler.max_forecast_ttft_s"]
  if cell["scheduler.admission"] == "watermark":
    if cell["scheduler.max_waiting"]:  # only the shipped line bounds the queue as well
      return "shipped", cell["scheduler.watermark"]
    return ("kv+wait", wait) if wait else ("kv", cell["scheduler.watermark"])
  for line, key in (("rate", "scheduler.rate_limit"), ("concurrency", "scheduler.max_concurrent"),
                    ("tokens", "scheduler.max_inflight_tokens"),
                    ("wait", "scheduler.max_forecast_ttft_s"),
                    ("slowdown", "scheduler.max_ttft_slowdown"),
                    ("queue", "scheduler.max_waiting")):
    if cell[key]:
      return line, cell[key]
  return "none", None


Where = tuple[str, str, str]  # (mix, arrivals, load), as the table names them


def cells(config: Any, scale: Scale, measured: dict[str, Any],
          chosen: dict[tuple[str, str, str, str], list[int]],
          table: dict[str, Any] | None = None, done: Set[str] = frozenset()) -> list[sweep.Cell]:
  """The runs of every (mix, arrivals, load, line) at its `chosen` ladder positions;
  `kv+wait` at the KV line's best watermark there (in `table`)."""
  ladder = ladders(measured)
  grid = []
  for (mix, arrival, load, line), positions in chosen.items():
    slos = measured[mix]
    rate = float(load.rstrip("x")) * slos["sustainable_requests_per_s"]
    for position in positions:
      setting = ladder[line][position]
      if line == "kv+wait":
        assert table is not None, "kv+wait is planned once the KV line's sweep settled"
        best = table[mix][arrival][load]["kv"]["best_knob"]
        setting = {**setting, "scheduler.watermark": float(best)}
      grid.append({**LINE_KEYS, **setting, "prompt_len": MIXES[mix],
                   "arrival_process": ARRIVALS[arrival], "arrival_rate": f"{rate:.4g}",
                   "slo_ttft": slos["slo_ttft_s"], "slo_tpot": slos["slo_tpot_s"]})
  return sweep.plan_cells(config, grid, range(scale.seeds), done)


def _knob_positions(measured: dict[str, Any]) -> dict[str, dict[str, int]]:
  """Per line, its knob values (as the table names them) -> their ladder positions."""
  return {line: {str(line_of({**LINE_KEYS, **setting})[1]): i
                 for i, setting in enumerate(settings)}
          for line, settings in ladders(measured).items()}


def analyze(rows: Sequence[dict], measured: dict[str, Any]) -> dict[str, Any]:
  """Per (mix, arrivals, load, line): every knob value's means over seeds (in ladder
  order; with each prompt-length class's share within the SLOs), the best value (most
  goodput) and its figures, each seed's goodput at it, whether that optimum is
  bracketed inside the values swept, and the best value by token-weighted goodput."""
  mixes = {spec: name for name, spec in MIXES.items()}
  arrivals = {spec: name for name, spec in ARRIVALS.items()}
  positions = _knob_positions(measured)
  groups: dict[tuple, list[dict]] = {}
  for row in rows:
    cell = row["cell"]
    mix = mixes[cell["prompt_len"]]
    load = round(float(cell["arrival_rate"]) / measured[mix]["sustainable_requests_per_s"], 2)
    line, knob = line_of(cell)
    groups.setdefault((mix, arrivals[cell["arrival_process"]], f"{load:g}x", line, str(knob)),
                      []).append(row)
  table: dict[str, Any] = {}
  for (mix, arrival, load, line, knob), group in sorted(
      groups.items(), key=lambda item: positions[item[0][3]].get(item[0][4], 0)):
    means: dict[str, Any] = {
        m: float(np.mean([r["metrics"].get(m) or 0.0 for r in group])) for m in FIGURES}
    for name, metric in CLASSES:  # (a class the mix never draws has none)
      shares = [r["metrics"].get(metric) for r in group]
      if all(share is not None for share in shares):
        means.setdefault("by_prompt_length", {})[name] = float(np.mean(shares))
    means["goodput_by_seed"] = [r["metrics"]["goodput_requests_per_s"] for r in group]
    entry = table.setdefault(mix, {}).setdefault(arrival, {}).setdefault(load, {}).setdefault(
        line, {"by_knob": {}})
    entry["by_knob"][knob] = means
  for by_arrival in table.values():
    for by_load in by_arrival.values():
      for by_line in by_load.values():
        for line, entry in by_line.items():
          knobs = list(entry["by_knob"])
          best = max(knobs, key=lambda k: entry["by_knob"][k]["goodput_requests_per_s"])
          entry["best_knob"] = best
          entry["best"] = entry["by_knob"][best]
          # Tuned for the token-weighted goodput instead (a line may be set to serve more
          # requests or more tokens).
          by_tokens = max(knobs, key=lambda k: entry["by_knob"][k]["goodput_token_fraction"])
          entry["best_tokens_knob"] = by_tokens
          entry["best_tokens"] = entry["by_knob"][by_tokens]
          at = positions[line]
          entry["best_at_edge"] = not claims.bracketed([at.get(k, 0) for k in knobs],
                                                       at.get(best, 0))
  return table


def extensions(table: dict[str, Any], measured: dict[str, Any],
               chosen: dict[tuple[str, str, str, str], list[int]]) -> int:
  """Adds to `chosen` the next ladder position past each optimum (by goodput, and by
  token-weighted goodput) found at the edge of its sweep; returns how many it added (0:
  every optimum is bracketed or at a ladder's end)."""
  positions, ladder, added = _knob_positions(measured), ladders(measured), 0
  for key, tried in chosen.items():
    mix, arrival, load, line = key
    entry = table[mix][arrival][load][line]
    for knob in dict.fromkeys((entry["best_knob"], entry["best_tokens_knob"])):
      best = positions[line][knob]
      step = -1 if best == min(tried) else 1 if best == max(tried) else 0
      if step and 0 <= best + step < len(ladder[line]) and best + step not in tried:
        tried.append(best + step)
        added += 1
  return added


def _verdict(holds: bool | None, why: str = "") -> str:
  return f"undecided: {why}" if holds is None else ("holds" if holds else "fails")


def claim_line_beats_none(table: dict[str, Any], mix: str, arrival: str,
                          load: str) -> dict[str, Any]:
  """At a load, the best line serves more goodput than no line at all."""
  by_line = table[mix][arrival][load]
  none = by_line["none"]["best"]["goodput_requests_per_s"]
  winner = max((line for line in by_line if line != "none"),
               key=lambda line: by_line[line]["best"]["goodput_requests_per_s"])
  best = by_line[winner]["best"]["goodput_requests_per_s"]
  holds = None if best == none == 0 else best > none
  return dict(claim=f"{mix}, {arrival}, {load}: holding a line serves more goodput than no "
                    "line", verdict=_verdict(holds, "no line and no policy serve anything"),
              evidence=f"best line {winner} ({by_line[winner]['best_knob']}) "
                       f"{best:.3f} req/s vs none {none:.3f} req/s")


def claim_kv_wins(table: dict[str, Any], mix: str, arrival: str, load: str) -> dict[str, Any]:
  """The KV line (alone, with the wait line, or as shipped) is the best line, within
  `TIE`."""
  by_line = table[mix][arrival][load]
  goodput = {line: entry["best"]["goodput_requests_per_s"] for line, entry in by_line.items()}
  top = max(goodput.values())
  kv = max(goodput.get(line, 0.0) for line in KV_LINES)
  holds = None if top == 0 else kv >= (1 - TIE) * top
  ranked = sorted(goodput, key=goodput.get, reverse=True)  # type: ignore[arg-type]
  return dict(claim=f"{mix}, {arrival}, {load}: the KV line (alone, with the wait line, or "
                    f"as shipped) serves within {TIE:.0%} of the best line's goodput",
              verdict=_verdict(holds, "no line serves anything within the SLOs"),
              evidence=", ".join(f"{line} {goodput[line]:.3f}" for line in ranked) + " req/s")


def claim_kv_wins_tokens(table: dict[str, Any], mix: str, arrival: str,
                         load: str) -> dict[str, Any]:
  """Weighted by prompt tokens, each line tuned for that, the KV line is still the best
  line within `TIE`: it does not win by refusing the long prompts."""
  by_line = table[mix][arrival][load]
  share = {line: entry["best_tokens"]["goodput_token_fraction"]
           for line, entry in by_line.items()}
  top = max(share.values())
  kv = max(share.get(line, 0.0) for line in KV_LINES)
  holds = None if top == 0 else kv >= (1 - TIE) * top
  ranked = sorted(share, key=share.get, reverse=True)  # type: ignore[arg-type]
  return dict(claim=f"{mix}, {arrival}, {load}: weighted by prompt tokens (each line tuned "
                    "for that), the KV line (alone, with the wait line, or as shipped) serves "
                    "within "
                    f"{TIE:.0%} of the best line",
              verdict=_verdict(holds, "no line serves any prompt token within the SLOs"),
              evidence=", ".join(f"{line} {share[line]:.1%}" for line in ranked)
              + " of offered prompt tokens within both SLOs")


def claim_combination_needed(table: dict[str, Any], mix: str, arrival: str,
                             load: str) -> dict[str, Any]:
  """KV + wait serves more goodput than either line alone, by more than `TIE`."""
  by_line = table[mix][arrival][load]
  both, kv, wait = (by_line[line]["best"]["goodput_requests_per_s"]
                    for line in ("kv+wait", "kv", "wait"))
  at_edge = [line for line in ("kv+wait", "kv", "wait") if by_line[line]["best_at_edge"]]
  holds = None if at_edge else both > (1 + TIE) * max(kv, wait)
  return dict(claim=f"{mix}, {arrival}, {load}: no single line suffices: KV + wait serves "
                    f"more than {TIE:.0%} more goodput than the KV line or the wait line "
                    "alone",
              verdict=_verdict(holds, f"the optimum of {', '.join(at_edge)} is not bracketed "
                                      "(at the edge of its sweep, or fewer than three values)"),
              evidence=f"kv+wait {both:.3f}, kv {kv:.3f}, wait {wait:.3f} req/s")


def _shipped(by_line: dict[str, Any]) -> dict[str, Any] | None:
  """The shipped line's figures at the shipped watermark (None: not run there)."""
  return by_line["shipped"]["by_knob"].get(str(SHIPPED_WATERMARK))


def claim_shipped_serves(table: dict[str, Any], mix: str, arrival: str,
                         load: str) -> dict[str, Any]:
  """The server's default line, untuned, serves within `TIE` of the best tuned line."""
  by_line = table[mix][arrival][load]
  shipped = _shipped(by_line)
  goodput = {line: entry["best"]["goodput_requests_per_s"] for line, entry in by_line.items()
             if line != "shipped"}
  best = max(goodput, key=goodput.get)  # type: ignore[arg-type]
  top = goodput[best]
  ours = None if shipped is None else shipped["goodput_requests_per_s"]
  holds = None if ours is None or top == 0 else ours >= (1 - TIE) * top
  why = ("the shipped watermark was not run" if ours is None else
         "no line serves anything")
  return dict(claim=f"{mix}, {arrival}, {load}: the shipped default (watermark "
                    f"{SHIPPED_WATERMARK:g}, forecast-TTFT line {SHIPPED_WAIT:g}x the TTFT "
                    f"SLO), untuned, serves within {TIE:.0%} of the best tuned line",
              verdict=_verdict(holds, why),
              evidence=f"shipped {ours if ours is None else f'{ours:.3f}'} vs {best} "
                       f"({by_line[best]['best_knob']}) {top:.3f} req/s; the shipped line's "
                       f"best watermark here {by_line['shipped']['best_knob']}")


def claim_shipped_keeps_running(table: dict[str, Any], mix: str, arrival: str,
                                load: str) -> dict[str, Any]:
  """Under the server's default line no running request is preempted or failed."""
  shipped = _shipped(table[mix][arrival][load])
  lost = None if shipped is None else (shipped["num_preemptions"], shipped["num_aborted"])
  holds = None if lost is None else lost == (0, 0)
  return dict(claim=f"{mix}, {arrival}, {load}: under the shipped default no running "
                    "request is preempted or failed",
              verdict=_verdict(holds, "the shipped watermark was not run"),
              evidence="not run" if lost is None else
                       f"preempted {lost[0]:g}, failed {lost[1]:g} (mean over seeds)")


def robustness(table: dict[str, Any], arrival: str, load: str) -> dict[str, Any]:
  """Per line, its best knob value in each mix at `load`: a line whose best value stays
  put across mixes needs no retuning when the traffic changes."""
  out: dict[str, Any] = {}
  mixes = list(table)
  for line in LINES[1:]:
    best = {mix: table[mix][arrival][load][line]["best_knob"] for mix in mixes
            if line in table[mix][arrival].get(load, {})}
    loss = {}  # goodput lost in each mix by using the other mix's best value
    for mix in best:
      entry = table[mix][arrival][load][line]
      others = [best[m] for m in best if m != mix]
      at_other = entry["by_knob"].get(others[0]) if others else None
      if at_other is not None:  # (None: an extended sweep never ran the other's best here)
        got = at_other["goodput_requests_per_s"]
        top = entry["best"]["goodput_requests_per_s"]
        loss[mix] = 0.0 if top == 0 else 1.0 - got / top
    out[line] = dict(best_knob=best, goodput_lost_retuned=loss)
  return out


def claims_of(table: dict[str, Any]) -> list[dict[str, Any]]:
  stated = []
  for mix in table:
    for arrival in table[mix]:
      for load in table[mix][arrival]:
        if float(load.rstrip("x")) < 2:
          continue  # the claims are about overload
        stated.append(claim_line_beats_none(table, mix, arrival, load))
        stated.append(claim_kv_wins(table, mix, arrival, load))
        stated.append(claim_kv_wins_tokens(table, mix, arrival, load))
        stated.append(claim_combination_needed(table, mix, arrival, load))
        stated.append(claim_shipped_serves(table, mix, arrival, load))
        stated.append(claim_shipped_keeps_running(table, mix, arrival, load))
  return stated


def run(scale: Scale, directory: pathlib.Path, *, show_progress: bool = True,
        setup: SimSetup = sim_setups.SETUPS[sim_setups.DEFAULT]) -> dict[str, Any]:
  """The study into `directory` (resumable) on `setup`; the record for study.json."""
  measured = measure(scale, setup, directory / "measure", show_progress)
  config = base(scale, setup)
  where = [(mix, arrival, f"{load:g}x") for mix in scale.mixes for arrival in scale.arrivals
           for load in scale.loads]
  # Every line alone first; then kv+wait, at the watermark the KV line settled on.
  chosen = {(*at, line): first_knobs(scale, ladder) for at in where
            for line, ladder in ladders(measured).items() if line != "kv+wait"}
  table: dict[str, Any] | None = None
  while True:
    planned = cells(config, scale, measured, chosen, table, sweep.done_ids(directory / "runs"))
    rows = sweep.run_sweep(config, planned, directory / "runs", show_progress=show_progress)
    table = analyze(rows, measured)
    if scale.extend and extensions(table, measured, chosen):
      continue
    if any(key[3] == "kv+wait" for key in chosen):
      break
    chosen.update({(*at, "kv+wait"): first_knobs(scale, ladders(measured)["kv+wait"])
                   for at in where})
  robust = {arrival: {load: robustness(table, arrival, load)
                      for load in next(iter(table.values()))[arrival]}
            for arrival in next(iter(table.values()))}
  return dict(scale=dataclasses.asdict(scale), setup=setup.name, context=CONTEXT,
              rules=dict(slo=f"each mix's SLOs: {SLO_FACTOR:g}x its unloaded run's TTFT p99 "
                             f"and median TPOT (unloaded: {UNLOADED:g}x its throughput with "
                             "everything offered at once)",
                         sustainable=f"the highest Poisson rate at which {ATTAINMENT:.0%} of "
                                     "requests meet both SLOs with no line (search: grow "
                                     "until it breaks, then bisect to "
                                     f"{scale.tolerance:.0%})",
                         knobs=ladders(measured),
                         goodput="requests within both SLOs (rejected requests count "
                                 "against it); token-weighted: the share of offered prompt "
                                 "tokens in requests within both SLOs, per prompt-length "
                                 "class too",
                         tie=f"goodputs within {TIE:.0%} of each other are a tie for the "
                             "claims",
                         combined="kv+wait: the watermark is the KV line's best at the "
                                  "same traffic and load, then the wait is swept",
                         extend="each line's sweep extends along its ladder until its "
                                "optima (requests and tokens) are bracketed" if scale.extend else
                                "each line's sweep is its ladder's middle values (not "
                                "extended: an optimum at an edge is undecided)"),
              measured=measured, table=table, robustness=robust,
              claims=claims_of(table), premises=rows[0]["premises"], rows=rows)


def figures(record: dict[str, Any]):
  """The two figures: every line at its best setting at 5x (or the highest load) for
  each mix, SLOs drawn; and each line's best goodput against the load."""
  import matplotlib.pyplot as plt

  from experiments import plots

  table, measured = record["table"], record["measured"]
  mixes = list(table)
  arrival = "steady" if "steady" in table[mixes[0]] else next(iter(table[mixes[0]]))
  loads = sorted(table[mixes[0]][arrival], key=lambda load: float(load.rstrip("x")))
  load = "5x" if "5x" in loads else loads[-1]
  colours = {line: plt.get_cmap("tab10")(i) for i, line in enumerate(LINES)}
  caption = (f"{record['setup']}, simulated; context {record['context']:,}; "
             f"{record['scale']['num_requests']} requests, {record['scale']['seeds']} seed(s); "
             f"{record['rules']['slo']}")
  panels = (("goodput_requests_per_s", "goodput (req/s)", None),
            ("num_preemptions", "preemptions of running requests", None),
            ("ttft_p99_s", "TTFT p99 (s)", "slo_ttft_s"),
            ("tpot_p99_s", "TPOT p99 (ms)", "slo_tpot_s"))
  bars, axes = plt.subplots(len(mixes), len(panels) + 1, figsize=(4.2 * (len(panels) + 1),
                                                                  3.2 * len(mixes)),
                            squeeze=False, constrained_layout=True)
  for row, mix in enumerate(mixes):
    by_line = table[mix][arrival][load]
    lines = [line for line in LINES if line in by_line]
    _by_prompt_length(axes[row, -1], by_line, lines)
    axes[row, -1].set_title(f"{mix}, {arrival}, {load}", fontsize=8)
    for column, (metric, label, slo) in enumerate(panels):
      ax = axes[row, column]
      scale = 1e3 if metric == "tpot_p99_s" else 1.0
      values = [scale * by_line[line]["best"][metric] for line in lines]
      bars_ = ax.bar(range(len(lines)), values, color=[colours[line] for line in lines])
      if not any(values):  # say so, rather than draw an empty panel around zero
        ax.set_ylim(0, 1)
        ax.text(0.5, 0.5, "0 at every line's best setting", transform=ax.transAxes,
                ha="center", va="center", fontsize=8)
      if column == 0:  # each line's best knob value, over its goodput bar
        ax.bar_label(bars_, [by_line[line]["best_knob"].replace("None", "")
                             for line in lines], fontsize=6, rotation=90, padding=2)
        ax.margins(y=0.25)
      ax.set_xticks(range(len(lines)), lines, rotation=45, ha="right", fontsize=7)
      ax.set_ylabel(label, fontsize=8)
      ax.set_title(f"{mix}, {arrival}, {load}", fontsize=8)
      if slo:  # latencies span orders of magnitude (no line: minutes): a log axis
        ax.set_yscale("log")
        unit = "ms" if scale != 1.0 else "s"
        plots.threshold(ax, scale * measured[mix][slo],
                        f"SLO {scale * measured[mix][slo]:.3g} {unit}")
      ax.grid(axis="y", alpha=0.3)
  bars.suptitle(f"each line at its best setting (most goodput), {load} load\n{caption}",
                fontsize=8)
  styles = {name: style for name, style in zip(ARRIVALS, ("-", ":"), strict=True)}
  curves, axes = plt.subplots(1, len(mixes), figsize=(5.5 * len(mixes), 4.0), squeeze=False,
                              constrained_layout=True)
  for column, mix in enumerate(mixes):
    ax = axes[0, column]
    for arrival_name, by_load in table[mix].items():
      xs = sorted(by_load, key=lambda load: float(load.rstrip("x")))
      for line in LINES:
        ys = [by_load[x][line]["best"]["goodput_requests_per_s"] for x in xs if line in by_load[x]]
        ax.plot([float(x.rstrip("x")) for x in xs], ys, styles[arrival_name], marker="o", ms=3,
                color=colours[line], label=f"{line} ({arrival_name})")
    plots.threshold(ax, 1.0, f"sustainable: {measured[mix]['sustainable_requests_per_s']:.2f} "
                    "req/s", vertical=True)
    ax.set_xlabel("load (x the mix's sustainable rate)")
    ax.set_ylabel("goodput at the line's best setting (req/s)")
    ax.set_title(mix, fontsize=9)
    ax.grid(alpha=0.3)
  plots.legend_outside(axes[0, -1])
  curves.suptitle(f"goodput against load, each line at its best setting\n{caption}",
                  fontsize=8)
  return bars, curves


def _by_prompt_length(ax: Any, by_line: dict[str, Any], lines: Sequence[str]) -> None:
  """Grouped bars: per line at its best setting, each prompt-length class's share within
  both SLOs, and the share of all offered prompt tokens (hatched)."""
  names = [name for name, _ in CLASSES
           if any(name in by_line[line]["best"].get("by_prompt_length", {}) for line in lines)]
  groups = [*names, "prompt tokens"]
  width = 0.8 / len(groups)
  shades = [0.35 + 0.5 * i / max(1, len(names) - 1) for i in range(len(names))]
  for i, group in enumerate(groups):
    values = [100 * (by_line[line]["best"]["goodput_token_fraction"] if group == "prompt tokens"
                     else by_line[line]["best"].get("by_prompt_length", {}).get(group, 0.0))
              for line in lines]
    colour = "white" if group == "prompt tokens" else str(shades[i])
    ax.bar(np.arange(len(lines)) + (i - (len(groups) - 1) / 2) * width, values, width,
           color=colour, edgecolor="black", linewidth=0.5,
           hatch="//" if group == "prompt tokens" else None,
           label=group if group == "prompt tokens" else f"prompt {group} tokens")
  ax.set_xticks(range(len(lines)), lines, rotation=45, ha="right", fontsize=7)
  ax.set_ylabel("within both SLOs (% of offered)", fontsize=8)
  ax.set_ylim(0, 100 + 12 * math.ceil(len(groups) / 2))  # the legend above the 100% line
  ax.set_yticks(range(0, 101, 20))
  ax.legend(fontsize=6, loc="upper center", ncol=2)
  ax.grid(axis="y", alpha=0.3)


def format_report(record: dict[str, Any]) -> str:
  lines = [f"line study on {record['setup']}: {record['rules']['slo']}"]
  for mix, m in record["measured"].items():
    lines.append(f"  {mix}: sustainable {m['sustainable_requests_per_s']:.2f} req/s, SLOs TTFT "
                 f"{m['slo_ttft_s']:.2f} s, TPOT {1e3 * m['slo_tpot_s']:.0f} ms")
  for mix, by_arrival in record["table"].items():
    for arrival, by_load in by_arrival.items():
      for load, by_line in by_load.items():
        lines.append(f"  {mix}, {arrival}, {load}:")
        for line, entry in by_line.items():
          f = entry["best"]
          classes = ", ".join(f"{name} {share:.0%}"
                              for name, share in f.get("by_prompt_length", {}).items())
          lines.append(
              f"    {line:<12} best {entry['best_knob']:<10} good "
              f"{f['goodput_requests_per_s']:.3f} req/s ({f['goodput_fraction']:.0%}; "
              f"{f['goodput_token_fraction']:.0%} of prompt tokens; by prompt length "
              f"{classes}), "
              f"preempted {f['num_preemptions']:.0f}, failed {f['num_aborted']:.0f}, 429 "
              f"{f['rejected_429']:.0f}, 503 {f['rejected_503']:.0f}, TTFT p99 "
              f"{f['ttft_p99_s']:.2f} s, TPOT p99 {1e3 * f['tpot_p99_s']:.0f} ms")
  for claim in record["claims"]:
    lines.append(f"  [{claim['verdict']}] {claim['claim']}: {claim['evidence']}")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  from experiments import plots  # fails now, not after the runs, without matplotlib

  with cli.workdir(flags.FLAGS.workdir) as directory:
    record = run(SCALES[sim_setups.SCALE.value], directory,
                 setup=sim_setups.SETUPS[sim_setups.SETUP.value])
    bars, curves = figures(record)
    plots.save(bars, directory / "lines_at_5x.png")
    plots.save(curves, directory / "goodput_by_load.png")
    record.pop("rows")
    cli.write_files(directory, {"study.json": json.dumps(record, indent=2)})
  print(format_report(record))
  print(f"\nwrote {directory}/study.json, lines_at_5x.png and goodput_by_load.png")


if __name__ == "__main__":
  cli.run(main)
