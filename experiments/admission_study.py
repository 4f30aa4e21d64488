r"""The admission study: the free-page watermark and the output estimate, under overload.

  python -m experiments.admission_study                     # the study's figures
  python -m experiments.admission_study --scale=smoke       # seconds, for CI
  python -m experiments.admission_study --sim_setup=yi_34b_a100_pcie_tp2 \
      --workdir=workdir/admission_study_yi34b                # calibrated Yi-34B TP 2

kvpage's thesis is that holding the KV-cache line at the door — admitting a request
only if the pages its prompt and its expected output need leave `watermark` of the
pool free — protects the requests already running: fewer preemptions, less work
thrown away and recomputed, steadier latency, with the overload pushed back as
429/503 plus a retry hint instead. The price is requests turned away that might
have fit. This study measures both sides on Llama-2-13B fp16, simulated on an 80 GB
A100 (or another deployment of `experiments.sim_setups`, `--sim_setup`): watermark
0 / 5 / 10 / 15 / 20 / 30% x output estimate (`max_tokens`: what the client asked for;
`fixed`: 256 tokens; `running_mean` of finished outputs) at 1x, 3x and 10x the
sustainable rate. Clients ask for `max_tokens` = 1,024 but use 32-512
(as real clients do), so the estimates differ.

The sustainable rate is measured first: the requests per second the engine finishes
with everything offered at once under the most permissive admission (watermark 0,
`fixed`). Reported per cell: rejections by status, preemptions, goodput under a TTFT
and TPOT SLO, TTFT p99, and the prefill recomputed after preemptions. `claims`
states from the numbers what holding the line buys and where a lower watermark wins.
"""

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import flags

from experiments import cli, serve_bench, sim_setups, sweep
from experiments.sim_setups import SimSetup

flags.FLAGS.set_default("workdir", "workdir/admission_study")

WATERMARKS = (0.0, 0.05, 0.10, 0.15, 0.20, 0.30)
ESTIMATES = ("max_tokens", "fixed", "running_mean")
LOADS = (1, 3, 10)  # x the sustainable rate
WORKLOAD = dict(prompt_len="lognormal:512:3000", output_len="uniform:32:512", max_tokens=1024)
SLO_TTFT_S = 5.0  # the goodput TPOT SLO is the setup's (`sim_setups`)


@dataclasses.dataclass(frozen=True)
class Scale:
  num_requests: int
  seeds: int
  watermarks: tuple[float, ...] = WATERMARKS
  estimates: tuple[str, ...] = ESTIMATES


SCALES = {"full": Scale(num_requests=600, seeds=3),
          "smoke": Scale(num_requests=200, seeds=1, watermarks=(0.0, 0.15, 0.30))}


def base(scale: Scale, setup: SimSetup) -> Any:
  """The study's base run: the setup's config, simulated, with the study's workload."""
  config = setup.get_config()
  if setup.hardware is not None:  # else the config's own device
    config.hardware = setup.hardware
  config.bench.update(dict(executor="sim", num_requests=scale.num_requests, **WORKLOAD,
                           slo_ttft=SLO_TTFT_S, slo_tpot=setup.goodput_tpot_slo_s))
  return config


def sustainable_rate(scale: Scale, setup: SimSetup) -> dict[str, Any]:
  """Requests/s finished with every request offered at once, admission at its most
  permissive (watermark 0, `fixed` estimate): the service rate."""
  config = base(scale, setup)
  config.scheduler.watermark = 0.0
  config.scheduler.output_estimate = "fixed"
  config.bench.arrival_rate = "inf"
  summary, _ = serve_bench.run_bench(config, show_progress=False)
  rate = summary["num_finished"] / summary["duration_s"]
  return dict(requests_per_s=rate, num_finished=summary["num_finished"],
              duration_s=summary["duration_s"], num_rejected=summary["num_rejected"])


def cells(scale: Scale, rate: float,
          setup: SimSetup) -> tuple[Any, list[sweep.Cell]]:
  config = base(scale, setup)
  grid = [{"scheduler.watermark": watermark, "scheduler.output_estimate": estimate,
           "arrival_rate": f"{load * rate:.4g}"}
          for load in LOADS for estimate in scale.estimates for watermark in scale.watermarks]
  return config, sweep.plan_cells(config, grid, range(scale.seeds))


FIGURES = ("rejected_400", "rejected_429", "rejected_503", "num_preemptions",
           "recomputed_tokens", "goodput_requests_per_s", "goodput_fraction", "ttft_p99_s",
           "tpot_p99_s", "max_kv_usage", "num_finished", "running_batch_mean")


def analyze(rows: Sequence[dict], rate: float) -> dict[str, Any]:
  """Mean figures over seeds per (load, estimate, watermark)."""
  table: dict[str, Any] = {}
  for row in rows:
    cell = row["cell"]
    load = round(float(cell["arrival_rate"]) / rate)
    key = (f"{load}x", cell["scheduler.output_estimate"], cell["scheduler.watermark"])
    table.setdefault(key, []).append(row)
  means = {}
  for (load, estimate, watermark), group in table.items():
    means.setdefault(load, {}).setdefault(estimate, {})[str(watermark)] = {
        # .get: rows resumed from before a figure was recorded lack it (read as 0).
        metric: float(np.mean([r["metrics"].get(metric) or 0.0 for r in group]))
        for metric in FIGURES}
  return means


def claims(means: dict[str, Any]) -> list[dict[str, Any]]:
  """What the numbers say of the thesis, each claim true or false, with its evidence.

  At 10x load, for each estimate: (1) the highest watermark preempts and recomputes
  no more than watermark 0 (strictly less where 0 preempted); (2) its TPOT p99 is no
  worse. At 1x load: (3) a lower watermark serves at least as much goodput as the
  highest — where the line costs more than it saves. (4) At each overload, for every
  estimate, goodput peaks at the highest watermark.
  """
  stated = []
  top_load, low_load = max(means, key=lambda k: int(k[:-1])), min(means, key=lambda k: int(k[:-1]))
  for estimate, by_watermark in means[top_load].items():
    marks = sorted(by_watermark, key=float)
    zero, high = by_watermark[marks[0]], by_watermark[marks[-1]]
    stated.append(dict(
        claim=f"at {top_load} load with the {estimate} estimate, watermark {marks[-1]} preempts "
              f"and recomputes no more than watermark {marks[0]}, and strictly less where "
              f"{marks[0]} preempted at all",
        holds=(high["num_preemptions"] <= zero["num_preemptions"]
               and high["recomputed_tokens"] <= zero["recomputed_tokens"]
               and (zero["num_preemptions"] == 0
                    or high["num_preemptions"] < zero["num_preemptions"])),
        evidence=f"preemptions {zero['num_preemptions']:.0f} -> {high['num_preemptions']:.0f}, "
                 f"recomputed tokens {zero['recomputed_tokens']:,.0f} -> "
                 f"{high['recomputed_tokens']:,.0f}, 503s {zero['rejected_503']:.0f} -> "
                 f"{high['rejected_503']:.0f}"))
    stated.append(dict(
        claim=f"at {top_load} load with the {estimate} estimate, holding the line does not "
              "cost running requests their pace (TPOT p99 no worse)",
        holds=high["tpot_p99_s"] <= zero["tpot_p99_s"] * 1.02,
        evidence=f"TPOT p99 {1e3 * zero['tpot_p99_s']:.1f} ms at {marks[0]} vs "
                 f"{1e3 * high['tpot_p99_s']:.1f} ms at {marks[-1]}"))
  for estimate, by_watermark in means[low_load].items():
    marks = sorted(by_watermark, key=float)
    best = max(marks, key=lambda m: by_watermark[m]["goodput_requests_per_s"])
    stated.append(dict(
        claim=f"at {low_load} load with the {estimate} estimate, a lower watermark serves at "
              f"least the goodput of the highest ({marks[-1]})",
        holds=(by_watermark[marks[0]]["goodput_requests_per_s"]
               >= by_watermark[marks[-1]]["goodput_requests_per_s"]),
        evidence="goodput req/s by watermark: " + ", ".join(
            f"{m}: {by_watermark[m]['goodput_requests_per_s']:.2f}" for m in marks)
                 + f" (best {best})"))
  for load in sorted(means, key=lambda k: int(k[:-1]))[1:]:  # the overloads
    best = {estimate: max(by_watermark, key=lambda m: by_watermark[m]["goodput_requests_per_s"])
            for estimate, by_watermark in means[load].items()}
    highest = {estimate: max(by_watermark, key=float)
               for estimate, by_watermark in means[load].items()}
    stated.append(dict(
        claim=f"at {load} load, for every estimate, goodput is highest at the highest watermark "
              "(turning requests away early serves more of the rest within the SLO)",
        holds=all(best[e] == highest[e] for e in best),
        evidence="; ".join(f"{e}: " + ", ".join(
            f"{m}: {f['goodput_requests_per_s']:.2f}" for m, f in means[load][e].items())
                           for e in means[load]) + " req/s"))
  return stated


def run(scale: Scale, directory: pathlib.Path, *, show_progress: bool = True,
        setup: SimSetup = sim_setups.SETUPS[sim_setups.DEFAULT]) -> dict[str, Any]:
  """The study into `directory` (resumable) on `setup`; the record written to study.json."""
  calibration = sustainable_rate(scale, setup)
  rate = calibration["requests_per_s"]
  config, grid = cells(scale, rate, setup)
  rows = sweep.run_sweep(config, grid, directory / "runs", show_progress=show_progress)
  means = analyze(rows, rate)
  return dict(scale=dataclasses.asdict(scale), setup=setup.name, sustainable=calibration,
              loads=list(LOADS), means=means, claims=claims(means),
              premises=rows[0]["premises"], rows=rows)


def curves(record: dict[str, Any]):
  """Per load, each figure against the watermark, a line per estimate."""
  from experiments import plots

  rate = record["sustainable"]["requests_per_s"]
  named = [dict(row, cell={"estimate": row["cell"]["scheduler.output_estimate"],
                           "watermark": row["cell"]["scheduler.watermark"],
                           "load": f"{round(float(row['cell']['arrival_rate']) / rate)}x",
                           "seed": row["cell"]["seed"]}) for row in record["rows"]]
  return plots.sweep_curves(named, x="watermark", lines=("load", "estimate"),
                            swept=("watermark", "output_estimate", "arrival_rate", "seed"),
                            title=f"admission study on {record['setup']}: watermark x "
                            "output estimate x load",
                            metrics=("rejected_503", "rejected_429", "num_preemptions",
                                     "recomputed_tokens", "goodput_requests_per_s",
                                     "ttft_p99_s", "tpot_p99_s", "max_kv_usage"))


def format_report(record: dict[str, Any]) -> str:
  rate = record["sustainable"]["requests_per_s"]
  lines = [f"sustainable rate {rate:.2f} req/s; loads {record['loads']} x that"]
  for load, by_estimate in record["means"].items():
    for estimate, by_watermark in by_estimate.items():
      lines.append(f"  {load:>4} {estimate:<13} " + "  ".join(
          f"w{m}: 503 {f['rejected_503']:.0f} pre {f['num_preemptions']:.0f} "
          f"good {f['goodput_requests_per_s']:.2f} batch {f['running_batch_mean']:.1f}"
          for m, f in by_watermark.items()))
  for claim in record["claims"]:
    lines.append(f"  [{'holds' if claim['holds'] else 'FAILS'}] {claim['claim']}: "
                 f"{claim['evidence']}")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  from experiments import plots  # fails now, not after the runs, without matplotlib

  with cli.workdir(flags.FLAGS.workdir) as directory:
    record = run(SCALES[sim_setups.SCALE.value], directory,
                 setup=sim_setups.SETUPS[sim_setups.SETUP.value])
    plots.save(curves(record), directory / "curves.png")
    record.pop("rows")
    cli.write_files(directory, {"study.json": json.dumps(record, indent=2)})
  print(format_report(record))
  print(f"\nwrote {directory}/study.json and curves.png")


if __name__ == "__main__":
  cli.run(main)
