r"""The admission study: the free-page watermark and the output estimate, under overload.

  python -m experiments.admission_study                     # the study's figure
  python -m experiments.admission_study --scale=smoke       # seconds, for CI
  python -m experiments.admission_study --sim_setup=yi_34b_a100_pcie_tp2 \
      --workdir=workdir/admission_study_yi34b                # calibrated Yi-34B TP 2

kvpage's thesis is that holding the KV-cache line at the door — admitting a request
only if the pages its prompt and its expected output need leave `watermark` of the
pool free — protects the requests already running: fewer preemptions, less prefill
thrown away and recomputed, steadier latency, with the overload pushed back as 503s
plus a retry hint instead. The price is requests turned away that might have fit.
This study measures both sides on Llama-2-13B fp16 simulated on an 80 GB A100 (or
another deployment of `experiments.sim_setups`, `--sim_setup`): watermark 0 / 5 / 10 /
15 / 20 / 30% x output estimate (`max_tokens`: what the client asked for; `fixed`: 256
tokens; `running_mean` of finished outputs) at 1x, 3x and 10x the sustainable rate.
Clients ask for `max_tokens` = 1,024 but use 32-512 (as real clients do), so the
estimates differ.

The thresholds are premises chosen by a stated rule, never constants, the line study's
own (`line_study.UNLOADED`, `line_study.SLO_FACTOR`) so that the studies agree: the
sustainable rate is the requests/s finished with everything offered at once at the most
permissive admission (watermark 0, `fixed`); from an unloaded run (0.05x that rate) the
TTFT SLO is 3x its TTFT p99 and the TPOT SLO 3x its median TPOT. Goodput is the share
of offered requests served within both SLOs (`goodput_fraction`, DistServe's SLO
attainment: a rejected request counts against it); per second of the run it would
credit a higher watermark with the shorter drain its rejections leave.

Where a load's goodput is best at the top watermark swept, that load's sweep grows by
`STEP` (up to `MAX_WATERMARK`) until the optimum lies inside it; each new value is a
sweep cell, so a rerun finds it done. The claims (`claims`), each a function of the
table of means that holds, fails or says why it cannot decide (`experiments.claims`),
with its thresholds beside it: without overload the line costs more than it saves;
under overload goodput peaks at a watermark above 0, inside the sweep; at the top load
holding the line prevents preemptions and keeps running requests' TPOT; an estimate
nearer the outputs clients use serves at least the goodput of `max_tokens` (a running
mean only where arrivals outlast the first request's finish). Everything goes to
`--workdir`, resumably: the sweep's rows, `study.json` and the figure `admission.png`.
"""

import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import flags

from experiments import claims as claims_lib
from experiments import cli, line_study, serve_bench, sim_setups, sweep
from experiments.sim_setups import SimSetup

flags.FLAGS.set_default("workdir", "workdir/admission_study")

WATERMARKS = (0.0, 0.05, 0.10, 0.15, 0.20, 0.30)
STEP, MAX_WATERMARK = 0.1, 0.8  # how the sweep grows past its top to bracket an optimum
ESTIMATES = ("max_tokens", "fixed", "running_mean")
LOADS = (1, 3, 10)  # x the sustainable rate
WORKLOAD = dict(prompt_len="lognormal:512:3000", output_len="uniform:32:512", max_tokens=1024)
FIGURES = ("num_finished", "num_rejected", "rejected_400", "rejected_429",
           "rejected_503", "num_preemptions", "recomputed_tokens", "goodput_fraction",
           "ttft_p99_s", "tpot_p99_s", "max_kv_usage", "running_batch_mean")
GOODPUT = "goodput_fraction"  # what the claims and the extension maximise
Means = Mapping[str, Mapping[str, Mapping[str, Mapping[str, float]]]]  # load/estimate/mark


@dataclasses.dataclass(frozen=True)
class Scale:
  """The study's size; `SCALES` holds the two the CLI offers."""

  num_requests: int  # per run, at every load (and at once, for the sustainable rate)
  seeds: int
  watermarks: tuple[float, ...] = WATERMARKS
  estimates: tuple[str, ...] = ESTIMATES
  loads: tuple[int, ...] = LOADS


SCALES = {"full": Scale(num_requests=600, seeds=3),
          "smoke": Scale(num_requests=200, seeds=1, watermarks=(0.0, 0.3, 0.6))}


def base(scale: Scale, setup: SimSetup) -> Any:
  """The study's base run: the setup's config, simulated, with the study's workload (its
  SLOs are set by `run` once measured)."""
  config = setup.get_config()
  if setup.hardware is not None:  # else the config's own device
    config.hardware = setup.hardware
  config.bench.update(dict(executor="sim", num_requests=scale.num_requests, **WORKLOAD))
  return config


def measure(scale: Scale, setup: SimSetup) -> dict[str, Any]:
  """The sustainable rate (everything offered at once, watermark 0, `fixed`) and when the
  first of those requests finished (before then a running mean has nothing to learn
  from); the SLOs from an unloaded run, by the line study's rule."""
  config = base(scale, setup)
  config.scheduler.update(dict(watermark=0.0, output_estimate="fixed"))
  config.bench.arrival_rate = "inf"
  saturated, files = serve_bench.run_bench(config, show_progress=False)
  rate = saturated["num_finished"] / saturated["duration_s"]
  ends = [json.loads(line) for line in files["requests.jsonl"].splitlines()]
  first = min(end["arrival"] + end["e2e_s"] for end in ends
              if end["finish_reason"] in ("length", "stop"))
  config.bench.arrival_rate = f"{line_study.UNLOADED * rate:.4g}"
  config.bench.num_requests = max(40, scale.num_requests // 5)
  unloaded, _ = serve_bench.run_bench(config, show_progress=False)
  factor = line_study.SLO_FACTOR
  return dict(sustainable_requests_per_s=rate, first_finish_s=first,
              unloaded_rate=line_study.UNLOADED * rate,
              unloaded_ttft_p99_s=unloaded["ttft_s"]["p99"],
              unloaded_tpot_p50_s=unloaded["tpot_s"]["p50"],
              slo_ttft_s=round(factor * unloaded["ttft_s"]["p99"], 4),
              slo_tpot_s=round(factor * unloaded["tpot_s"]["p50"], 4))


def rules() -> dict[str, str]:
  """How each threshold was chosen, in words, for `study.json` and the figure."""
  return dict(
      slo=f"each SLO {line_study.SLO_FACTOR:g}x an unloaded run's figure: its TTFT p99, its "
          f"median TPOT (unloaded: {line_study.UNLOADED:g}x the sustainable rate)",
      sustainable="requests/s finished with everything offered at once, watermark 0, "
                  "fixed estimate",
      learning="a running mean is judged only at a load whose arrivals last longer than "
               "the first finish with everything offered at once",
      goodput="share of offered requests served within both SLOs (rejections count against)",
      watermarks=f"grown by {STEP:g} past the top while the best goodput is there, up to "
                 f"{MAX_WATERMARK:g}")


def load_name(load: float) -> str:
  return f"{load:g}x"


def cells(scale: Scale, config: Any, rate: float,
          marks: Mapping[tuple[int, str], Sequence[float]]) -> list[sweep.Cell]:
  """A cell per (load, estimate, watermark in `marks[load, estimate]`) and seed."""
  grid = [{"scheduler.watermark": watermark, "scheduler.output_estimate": estimate,
           "arrival_rate": f"{load * rate:.4g}"}
          for (load, estimate), watermarks in marks.items() for watermark in watermarks]
  return sweep.plan_cells(config, grid, range(scale.seeds))


def analyze(rows: Sequence[dict], rate: float, loads: Sequence[int]) -> dict[str, Any]:
  """Mean figures over seeds per load, estimate and watermark: the table claims read."""
  load_of = {f"{load * rate:.4g}": load_name(load) for load in loads}
  groups: dict[tuple[str, str, str], list[dict]] = {}
  for row in rows:
    cell = row["cell"]
    key = (load_of[cell["arrival_rate"]], cell["scheduler.output_estimate"],
           str(cell["scheduler.watermark"]))
    groups.setdefault(key, []).append(row)
  means: dict[str, Any] = {}
  for (load, estimate, watermark), group in sorted(
      groups.items(), key=lambda item: (float(item[0][0][:-1]), item[0][1], float(item[0][2]))):
    means.setdefault(load, {}).setdefault(estimate, {})[watermark] = {
        metric: float(np.mean([r["metrics"].get(metric) or 0.0 for r in group]))
        for metric in FIGURES}
  return means


def optimum(by_watermark: Mapping[str, Mapping[str, float]]) -> tuple[str, str]:
  """The watermark of most goodput (the lowest of a tie) and where it lies: "inside" the
  sweep (bracketed), at its "lowest" value, at its "top" (the highest value reaches the
  best goodput, so the optimum may lie past it), or "flat" (the same goodput at every
  watermark: nothing to choose)."""
  marks = sorted(by_watermark, key=float)
  goodput = [by_watermark[mark][GOODPUT] for mark in marks]
  best = marks[int(np.argmax(goodput))]
  if len(set(goodput)) == 1:
    return best, "flat"
  if goodput[-1] == max(goodput):
    return best, "top"
  if claims_lib.bracketed([float(mark) for mark in marks], float(best)):
    return best, "inside"
  return best, "lowest"


def next_watermark(by_watermark: Mapping[str, Mapping[str, float]]) -> float | None:
  """The value that extends the sweep when its optimum is at the top (None: bracketed,
  or `MAX_WATERMARK` reached)."""
  top = max(float(mark) for mark in by_watermark)
  if optimum(by_watermark)[1] != "top" or top + STEP > MAX_WATERMARK + 1e-9:
    return None
  return round(top + STEP, 2)


def _ends(by_watermark: Mapping[str, Any]) -> tuple[str, str]:
  marks = sorted(by_watermark, key=float)
  return marks[0], marks[-1]


def _triggered(low: Mapping[str, float], high: Mapping[str, float]) -> bool:
  """Whether the higher watermark changed anything: turned away, preempted or finished
  a different number of requests (else the line never triggered: a tie is no evidence)."""
  return any(low[m] != high[m] for m in ("num_rejected", "num_preemptions", "num_finished"))


def _share(value: float) -> str:
  return f"{100 * value:.1f}%"


def _goodputs(by_watermark: Mapping[str, Mapping[str, float]]) -> str:
  return ", ".join(f"{mark}: {_share(by_watermark[mark][GOODPUT])}"
                   for mark in sorted(by_watermark, key=float))


def claim_protects(means: Means, load: str, estimate: str,
                   premises: Mapping[str, Any]) -> dict[str, Any]:
  """Holding the line hard (the highest watermark swept) preempts fewer running requests
  than watermark 0 and recomputes no more prefill."""
  low, high = _ends(means[load][estimate])
  zero, top = means[load][estimate][low], means[load][estimate][high]
  holds = (None if zero["num_preemptions"] == 0 else
           top["num_preemptions"] < zero["num_preemptions"]
           and top["recomputed_tokens"] <= zero["recomputed_tokens"])
  return claims_lib.claim(
      f"at {load} load with the {estimate} estimate, watermark {high} preempts fewer running "
      f"requests than watermark {low} and recomputes no more prefill", holds,
      f"preemptions {zero['num_preemptions']:.0f} -> {top['num_preemptions']:.0f}, recomputed "
      f"tokens {zero['recomputed_tokens']:,.0f} -> {top['recomputed_tokens']:,.0f}, rejected "
      f"{zero['num_rejected']:.0f} -> {top['num_rejected']:.0f}",
      why=f"watermark {low} preempted nothing: no preemption for the line to prevent",
      premises={**premises, "watermarks": [low, high]})


def claim_keeps_pace(means: Means, load: str, estimate: str,
                     premises: Mapping[str, Any]) -> dict[str, Any]:
  """Holding the line hard does not cost running requests their pace: TPOT p99 at the
  highest watermark no worse than at watermark 0."""
  low, high = _ends(means[load][estimate])
  zero, top = means[load][estimate][low], means[load][estimate][high]
  why = ""
  if not _triggered(zero, top):
    why = f"watermark {high} turned away and preempted as {low} did: the line never triggered"
  elif not (zero["tpot_p99_s"] and top["tpot_p99_s"]):
    why = "no TPOT was measured at one of the two watermarks"
  return claims_lib.claim(
      f"at {load} load with the {estimate} estimate, holding the line (watermark {high}) "
      f"keeps running requests' pace: TPOT p99 no worse than at watermark {low}",
      None if why else top["tpot_p99_s"] <= zero["tpot_p99_s"],
      f"TPOT p99 {1e3 * zero['tpot_p99_s']:.1f} ms at {low} vs {1e3 * top['tpot_p99_s']:.1f} "
      f"ms at {high}", why=why, premises={**premises, "watermarks": [low, high]})


def claim_costs_unloaded(means: Means, load: str, estimate: str,
                         premises: Mapping[str, Any]) -> dict[str, Any]:
  """Without overload the line costs more than it saves: watermark 0 serves at least the
  goodput of the highest watermark."""
  low, high = _ends(means[load][estimate])
  zero, top = means[load][estimate][low], means[load][estimate][high]
  why = ""
  if not _triggered(zero, top):
    why = f"watermark {high} turned away and preempted as {low} did: the line never triggered"
  elif zero[GOODPUT] == top[GOODPUT] == 0:
    why = "neither watermark serves any request within the SLOs"
  return claims_lib.claim(
      f"at {load} load with the {estimate} estimate, watermark {low} serves at least the "
      f"goodput of the highest ({high}): without overload the line costs more than it saves",
      None if why else zero[GOODPUT] >= top[GOODPUT],
      f"goodput by watermark: {_goodputs(means[load][estimate])}; rejected "
      f"{zero['num_rejected']:.0f} -> {top['num_rejected']:.0f}",
      why=why, premises={**premises, "watermarks": [low, high]})


def claim_line_pays(means: Means, load: str, estimate: str,
                    premises: Mapping[str, Any]) -> dict[str, Any]:
  """Under overload, goodput peaks at a watermark above the lowest, inside the sweep:
  turning requests away early serves more of the rest within the SLOs."""
  by_watermark = means[load][estimate]
  best, where = optimum(by_watermark)
  low, high = _ends(by_watermark)
  why = {"flat": f"goodput is {_share(by_watermark[best][GOODPUT])} at every watermark: "
                 "nothing to choose",
         "top": f"the highest watermark swept ({high}) serves the best goodput: the optimum "
                "may lie past the sweep"}.get(where, "")
  return claims_lib.claim(
      f"at {load} load with the {estimate} estimate, goodput peaks at a watermark above "
      f"{low}, inside the sweep (holding the line serves more within the SLOs than not)",
      None if why else where == "inside",
      f"goodput by watermark: {_goodputs(by_watermark)} (best {best})", why=why,
      premises={**premises, "watermarks": [low, high], "best_watermark": best})


def claim_estimate_pays(means: Means, load: str, estimate: str, premises: Mapping[str, Any],
                        reference: str = "max_tokens") -> dict[str, Any]:
  """An estimate nearer the outputs clients use, at its best watermark, serves at least
  the goodput of `reference` (what clients ask for) at its best."""
  mine, theirs = means[load][estimate], means[load][reference]
  (best, where), (best_ref, where_ref) = optimum(mine), optimum(theirs)
  shared = set(mine) & set(theirs)
  window, first = premises["arrival_window_s"], premises["first_finish_s"]
  why = ""
  if estimate == "running_mean" and window <= first:
    why = (f"arrivals end after {window:.1f} s, before the first request finishes with "
           f"everything offered at once ({first:.1f} s): the running mean has little or "
           "nothing to learn from while requests arrive")
  elif shared and all(mine[mark] == theirs[mark] for mark in shared):
    why = (f"{estimate} ran exactly as {reference} at every watermark: the estimates never "
           "differed (a running mean is max_tokens until a request finishes)")
  elif "top" in (where, where_ref):
    edged = [name for name, at in ((estimate, where), (reference, where_ref)) if at == "top"]
    why = f"the optimum of {' and '.join(edged)} lies at the top of its sweep"
  elif mine[best][GOODPUT] == theirs[best_ref][GOODPUT] == 0:
    why = "neither estimate serves any request within the SLOs"
  return claims_lib.claim(
      f"at {load} load, the {estimate} estimate at its best watermark serves at least the "
      f"goodput of {reference} at its best (an estimate nearer the outputs admits more)",
      None if why else mine[best][GOODPUT] >= theirs[best_ref][GOODPUT],
      f"goodput {estimate} {_share(mine[best][GOODPUT])} at {best} vs {reference} "
      f"{_share(theirs[best_ref][GOODPUT])} at {best_ref}", why=why,
      premises={**premises, "best_watermarks": {estimate: best, reference: best_ref}})


def claims(means: Means, measured: Mapping[str, Any],
           num_requests: int) -> list[dict[str, Any]]:
  """Every claim on the table, each with its thresholds: at the lowest load the line's
  cost; at every overload where goodput peaks and what the estimates buy; at the top load
  what holding the line protects."""
  loads = sorted(means, key=lambda load: float(load[:-1]))
  stated: list[dict[str, Any]] = []

  def judge(claim: Callable[..., dict[str, Any]], *args: Any) -> None:  # tagged: its kind
    stated.append(dict(claim(means, *args), kind=claim.__name__.removeprefix("claim_")))

  for load in loads:
    rate = float(load[:-1]) * measured["sustainable_requests_per_s"]
    premises = dict(slo_ttft_s=measured["slo_ttft_s"], slo_tpot_s=measured["slo_tpot_s"],
                    sustainable_requests_per_s=measured["sustainable_requests_per_s"],
                    arrival_rate_per_s=rate, arrival_window_s=num_requests / rate,
                    first_finish_s=measured["first_finish_s"])
    for estimate in means[load]:
      if load == loads[0]:
        judge(claim_costs_unloaded, load, estimate, premises)
        continue
      judge(claim_line_pays, load, estimate, premises)
      if load == loads[-1]:
        judge(claim_protects, load, estimate, premises)
        judge(claim_keeps_pace, load, estimate, premises)
    for estimate in means[load]:
      if load != loads[0] and "max_tokens" in means[load] and estimate != "max_tokens":
        judge(claim_estimate_pays, load, estimate, premises)
  return stated


def run(scale: Scale, directory: pathlib.Path, *, show_progress: bool = True,
        setup: SimSetup = sim_setups.SETUPS[sim_setups.DEFAULT]) -> dict[str, Any]:
  """The study into `directory` (resumable) on `setup`: measure, sweep (growing each
  load's watermarks until its optimum is bracketed), judge. The record for study.json."""
  measured = measure(scale, setup)
  rate = measured["sustainable_requests_per_s"]
  config = base(scale, setup)
  config.bench.update(dict(slo_ttft=measured["slo_ttft_s"], slo_tpot=measured["slo_tpot_s"]))
  marks = {(load, estimate): list(scale.watermarks)
           for load in scale.loads for estimate in scale.estimates}
  while True:
    rows = sweep.run_sweep(config, cells(scale, config, rate, marks), directory / "runs",
                           show_progress=show_progress)
    means = analyze(rows, rate, scale.loads)
    grown = {key: next_watermark(means[load_name(key[0])][key[1]]) for key in marks}
    if not any(value is not None for value in grown.values()):
      break
    for key, value in grown.items():
      if value is not None:
        marks[key].append(value)
  optima = {load: {estimate: dict(zip(("watermark", "where"), optimum(by_watermark),
                                      strict=True))
                   for estimate, by_watermark in by_estimate.items()}
            for load, by_estimate in means.items()}
  return dict(scale=dataclasses.asdict(scale), setup=setup.name, measured=measured,
              rules=rules(), loads=list(scale.loads), means=means, optima=optima,
              claims=claims(means, measured, scale.num_requests),
              premises=rows[0]["premises"], rows=rows)


def figure(record: Mapping[str, Any]) -> Any:
  """The study's matplotlib figure: a column per load, a row per figure against the
  watermark, a colour (and marker and dash) per estimate, the SLOs drawn; a figure that
  is zero in every run is left out, one zero at a load says so in its panel's title."""
  import matplotlib.pyplot as plt

  from experiments import plots

  means, measured = record["means"], record["measured"]
  loads = sorted(means, key=lambda load: float(load[:-1]))
  rows = [(GOODPUT, "goodput (% of offered)", 100.0, None),
          ("num_rejected", "rejected (requests)", 1.0, None),
          ("num_preemptions", "preemptions (count)", 1.0, None),
          ("recomputed_tokens", "recomputed prefill (tokens)", 1.0, None),
          ("ttft_p99_s", "TTFT p99 (s)", 1.0, "slo_ttft_s"),
          ("tpot_p99_s", "TPOT p99 (ms)", 1e3, "slo_tpot_s")]

  def values(load: str, metric: str) -> list[float]:
    return [f[metric] for by_mark in means[load].values() for f in by_mark.values()]

  zero = [name for name, *_ in rows if not any(v for load in loads for v in values(load, name))]
  rows = [row for row in rows if row[0] not in zero]
  estimates = list(dict.fromkeys(e for load in loads for e in means[load]))
  styles = {e: dict(color=plt.get_cmap("tab10")(i), marker="osD^v"[i % 5],
                    ls=("-", "--", ":", "-.")[i % 4], ms=7 - 1.5 * i, lw=2.2 - 0.5 * i)
            for i, e in enumerate(estimates)}
  fig, axes = plt.subplots(len(rows), len(loads), figsize=(4.3 * len(loads) + 1.5,
                                                           2.6 * len(rows)),
                           squeeze=False, constrained_layout=True)
  for column, load in enumerate(loads):
    for row, (metric, label, scale, slo) in enumerate(rows):
      ax = axes[row, column]
      silent = not any(values(load, metric))
      for estimate, by_mark in means[load].items():
        marks = sorted(by_mark, key=float)
        ax.plot([float(m) for m in marks], [scale * by_mark[m][metric] for m in marks],
                label=estimate, **styles[estimate], alpha=0.15 if silent else 1.0)
      if slo:
        unit = label.split("(")[-1].rstrip(")")
        plots.threshold(ax, scale * measured[slo], f"SLO {scale * measured[slo]:.3g} {unit}")
      ax.set_title(f"{load} load" + (": zero in every run" if silent else ""), fontsize=8)
      ax.set_xlabel("watermark (fraction of KV pages kept free)", fontsize=7)
      ax.set_ylabel(label, fontsize=8)
      ax.grid(alpha=0.3)
  plots.legend_outside(axes[0, -1], title="output estimate")
  dropped = f"; zero in every run, not drawn: {', '.join(zero)}" if zero else ""
  premises = plots.premises_line(record["premises"], ("scheduler.watermark", "seed",
                                                      "scheduler.output_estimate",
                                                      "arrival_rate"))
  fig.suptitle(
      f"admission study on {record['setup']}: watermark x output estimate x load "
      f"(mean over {record['scale']['seeds']} seed(s))\n{premises}\n"
      f"SLOs TTFT {measured['slo_ttft_s']:.3g} s, TPOT {1e3 * measured['slo_tpot_s']:.3g} ms "
      f"({record['rules']['slo']}); sustainable "
      f"{measured['sustainable_requests_per_s']:.3g} req/s; goodput: "
      f"{record['rules']['goodput']}{dropped}", fontsize=8)
  return fig


def format_report(record: Mapping[str, Any]) -> str:
  measured = record["measured"]
  lines = [f"sustainable rate {measured['sustainable_requests_per_s']:.2f} req/s; loads "
           f"{record['loads']} x that; SLOs TTFT {measured['slo_ttft_s']:.3g} s, TPOT "
           f"{1e3 * measured['slo_tpot_s']:.3g} ms ({record['rules']['slo']})"]
  for load, by_estimate in record["means"].items():
    for estimate, by_watermark in by_estimate.items():
      lines.append(f"  {load:>4} {estimate:<13} " + "  ".join(
          f"w{m}: rej {f['num_rejected']:.0f} pre {f['num_preemptions']:.0f} "
          f"good {_share(f[GOODPUT])}" for m, f in by_watermark.items()))
  lines.extend(f"  [{claim['verdict']}] {claim['claim']}: {claim['evidence']}"
               for claim in record["claims"])
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  from experiments import plots  # fails now, not after the runs, without matplotlib

  with cli.workdir(flags.FLAGS.workdir) as directory:
    record = run(SCALES[sim_setups.SCALE.value], directory,
                 setup=sim_setups.SETUPS[sim_setups.SETUP.value])
    plots.save(figure(record), directory / "admission.png")
    record.pop("rows")
    cli.write_files(directory, {"study.json": json.dumps(record, indent=2)})
  print(format_report(record))
  print(f"\nwrote {directory}/study.json and admission.png")


if __name__ == "__main__":
  cli.run(main)
