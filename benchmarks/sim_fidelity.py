r"""Does a calibrated simulator predict a real run? The tiny model on this CPU.

  python -m benchmarks.sim_fidelity --out=sim_fidelity.json [--repeats=3]

1. Runs the real tiny model (`serve_bench --executor=jax`, warm-up before the clock)
   on workload A and keeps its `steps.jsonl`.
2. Fits the step rates on A's steps (`experiments.calibrate`, hardware `cpu`, the fit's
   `--weighting` and `--loss`). The defaults, `by_kind` and `absolute`, are what a
   served run needs: ~97% of its steps are short decode steps whose times have a long
   tail, so a least-squares fit weighted by seconds prices the few long mixed steps
   well and every decode step at its mean, ~15-20% above the median step it is judged
   on. Measured on the 2-core VM: `absolute` weighting with `squares` missed the
   median step in 3 of 3 repeats, `by_kind` with `squares` in 2 of 2; `by_kind` with
   `absolute` held every target in 2 of 2. The fit separates the steps launched after
   the engine idled (`StepRates.idle_launch_s`): without that term the cold prompt
   steps that open each busy spell priced every warm mixed step ~1.5x too high, and
   TTFT p50 came out +2% to +31% (4 of 10 pairs of real runs over +20%); with it
   -15% to +13% on the same 10 pairs, and -19%, -5%, -17% in 3 fresh repeats.
3. Runs workload B, with other lengths and another arrival rate, twice: for real, and
   simulated with that calibration (same trace, same pool, same scheduler).
4. Compares B's median step time, TTFT p50 and TPOT p50, simulated against measured
   (the targets: within 15% on the median step and 20% on TTFT and TPOT p50), and
   also the calibration's error on B's real steps one by one.

Prints a table and writes JSON with the premises (model, dtype, workloads, pool,
scheduler, machine, versions). Every run is a subprocess, so each starts cold the same
way, and the compilation cache is shared between the real runs. `--repeats` runs the
whole procedure again (new real runs, a new fit), since real step times on a shared
CPU vary from run to run; the record keeps every repeat and how many held each target.
"""

import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

from kvpage import premises

_CONFIG = flags.DEFINE_string("config", "configs/tiny.py", "The model that runs (file).")
_WORKLOAD_A = flags.DEFINE_list(
    "workload_a", ["--num_requests=64", "--arrival_rate=8", "--prompt_len=uniform:16:400",
                   "--output_len=uniform:16:96"], "serve_bench flags of the calibration run.")
_WORKLOAD_B = flags.DEFINE_list(
    "workload_b", ["--num_requests=64", "--arrival_rate=16", "--prompt_len=lognormal:48:600",
                   "--output_len=uniform:32:128", "--seed=1"],
    "serve_bench flags of the run the simulator predicts.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 1024, "KV pages of both runs (same pool).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Keep the runs here (default: a temp dir).")
_OUT = flags.DEFINE_string("out", "sim_fidelity.json", "Where to write the JSON record.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Times to run the whole procedure.")
_WEIGHTING = flags.DEFINE_enum(
    "weighting", "by_kind", ["absolute", "relative", "by_kind"], "The fit's weighting "
    "(experiments.calibrate --weighting): seconds, each step's relative error, or "
    "seconds with each kind of step weighing the same.")

_LOSS = flags.DEFINE_enum(
    "loss", "absolute", ["squares", "absolute"], "The fit's loss (experiments.calibrate "
    "--loss): squared errors (a mean fit) or absolute ones (a median fit).")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(module: str, *argv: str) -> str:
  result = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT,
                          capture_output=True, text=True)
  if result.returncode != 0:
    raise SystemExit(f"{module} {' '.join(argv)} failed:\n{result.stderr[-3000:]}")
  return result.stdout


def _bench(workdir: pathlib.Path, name: str, workload: list[str], *extra: str) -> dict:
  directory = workdir / name
  _run("experiments.serve_bench", f"--config={_CONFIG.value}", f"--num_pages={_NUM_PAGES.value}",
       f"--workdir={directory}", f"--compilation_cache={workdir / 'xla_cache'}", *workload,
       *extra)
  summary = json.loads((directory / "summary.json").read_text())
  steps = [json.loads(line) for line in (directory / "steps.jsonl").read_text().splitlines()]
  times = [row["step_s"] for row in steps if row.get("step_s")]
  return dict(summary=summary, median_step_s=statistics.median(times), num_steps=len(times),
              steps_file=str(directory / "steps.jsonl"))


def main(argv: list[str]) -> None:
  del argv  # Unused.
  if _REPEATS.value < 1:
    raise SystemExit(f"--repeats must be >= 1, got {_REPEATS.value}")
  workdir = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="kvpage_fidelity_"))
  records = [measure(workdir / f"repeat_{i}" if _REPEATS.value > 1 else workdir)
             for i in range(_REPEATS.value)]
  holds = {row["metric"]: sum(r["table"][i]["holds"] for r in records)
           for i, row in enumerate(records[0]["table"])}
  record = dict(records[0], repeats=records, holds_in=holds) if len(records) > 1 else records[0]
  pathlib.Path(_OUT.value).write_text(json.dumps(record, indent=1) + "\n")
  if len(records) > 1:
    print("held in " + ", ".join(f"{metric} {count}/{len(records)}"
                                 for metric, count in holds.items()))
  print(f"wrote {_OUT.value}")


def measure(workdir: pathlib.Path) -> dict:
  """One whole procedure in `workdir`: calibrate on A, predict B; prints its table."""
  real_a = _bench(workdir, "real_a", _WORKLOAD_A.value)
  calibration_file = workdir / "cpu_calibration.json"
  fit = json.loads(_run("experiments.calibrate", f"--config={_CONFIG.value}", "--hardware=cpu",
                        f"--steps={real_a['steps_file']}", f"--out={calibration_file}",
                        f"--weighting={_WEIGHTING.value}", f"--loss={_LOSS.value}", "--json"))
  real_b = _bench(workdir, "real_b", _WORKLOAD_B.value)
  sim_b = _bench(workdir, "sim_b", _WORKLOAD_B.value, "--executor=sim", "--hardware=cpu",
                 f"--calibration={calibration_file}")
  held = json.loads(_run("experiments.calibrate", f"--config={_CONFIG.value}", "--hardware=cpu",
                         f"--steps={real_a['steps_file']}",
                         f"--test_steps={real_b['steps_file']}",
                         f"--weighting={_WEIGHTING.value}", f"--loss={_LOSS.value}", "--json"))
  errors = sorted(abs(row["error"]) for row in held["points"] if row["split"] == "held-out")

  def p50(run: dict, key: str) -> float:
    return run["summary"][key]["p50"]

  rows = [("median step", real_b["median_step_s"], sim_b["median_step_s"], 0.15),
          ("TTFT p50", p50(real_b, "ttft_s"), p50(sim_b, "ttft_s"), 0.20),
          ("TPOT p50", p50(real_b, "tpot_s"), p50(sim_b, "tpot_s"), 0.20)]
  table = [dict(metric=name, measured_s=measured, simulated_s=simulated,
                error=simulated / measured - 1.0, target=target,
                holds=abs(simulated / measured - 1.0) <= target)
           for name, measured, simulated, target in rows]
  record = dict(
      premises=dict(config=_CONFIG.value, weighting=_WEIGHTING.value, loss=_LOSS.value,
                    workload_a=_WORKLOAD_A.value,
                    workload_b=_WORKLOAD_B.value, num_pages=_NUM_PAGES.value,
                    model=real_b["summary"]["premises"]["model"],
                    policies=real_b["summary"]["premises"]["policies"], **premises.environment()),
      calibration=dict(rates=fit["rates"], train_steps=fit["premises"]["num_train"],
                       rms_relative_error=fit["premises"]["rms_relative_error"]),
      per_step_error_on_b=dict(num_steps=len(errors), median=errors[len(errors) // 2],
                               p90=errors[int(0.9 * (len(errors) - 1))]),
      steps=dict(real_a=real_a["num_steps"], real_b=real_b["num_steps"],
                 sim_b=sim_b["num_steps"]),
      table=table)
  print(f"sim fidelity: {_CONFIG.value}, calibrated ({_WEIGHTING.value} weighting, "
        f"{_LOSS.value} loss) on {real_a['num_steps']} real steps of "
        f"workload A ({' '.join(_WORKLOAD_A.value)}), predicting workload B "
        f"({' '.join(_WORKLOAD_B.value)}), {_NUM_PAGES.value} pages")
  print(f"{'metric':<14} {'measured ms':>12} {'simulated ms':>13} {'error':>8} {'target':>7}")
  for row in table:
    print(f"{row['metric']:<14} {1e3 * row['measured_s']:>12.2f} {1e3 * row['simulated_s']:>13.2f}"
          f" {100 * row['error']:>+7.1f}% {'<=' + format(row['target'], '.0%'):>7} "
          f"{'holds' if row['holds'] else 'MISSES'}")
  print(f"calibration on B's real steps, one by one: |error| median "
        f"{100 * record['per_step_error_on_b']['median']:.1f}%, p90 "
        f"{100 * record['per_step_error_on_b']['p90']:.1f}% over {len(errors)} steps")
  return record


if __name__ == "__main__":
  app.run(main)
