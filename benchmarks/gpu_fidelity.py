r"""Does the simulator predict a real GPU it was never fitted on? One trace, run twice.

  python -m benchmarks.gpu_fidelity --out=gpu_fidelity.json    # on a GPU (an H200)
  python -m benchmarks.gpu_fidelity --smoke --out=smoke.json   # this CPU: the pipeline

1. Runs the real engine (`serve_bench --executor=jax`, every step shape compiled before
   the clock) with random weights of `--config` (Llama-2-13B in bf16) on this machine's
   accelerator, on a short mixed workload: prompts of 64 to 1,024 tokens arriving as a
   Poisson stream, so steps mix prompt chunks with decodes.
2. Replays the very trace that run wrote (`trace.jsonl`) through the simulator on
   `--hardware` (`h200_141gb`: no measurements of its own; the A100 PCIe calibration
   carried over by the datasheets' ratios, `kvpage.sim.operators`), with the same page
   pool and scheduler.
3. Prints the median step time, TTFT p50 and TPOT p50 (and their p90s) side by side,
   measured against simulated, with each error; writes JSON with the premises (model,
   dtype, workload, pool, hardware, calibration, machine, versions).

No targets: the simulator's GPU rates are an A100's, carried; this records how far that
carries to another device and another engine (kvpage's kernels, not vLLM's), part by
part in each run's `steps.jsonl`. `--smoke` runs the same procedure with the tiny model
on this CPU against the `cpu` entry's template rates, a check that the pipeline runs (CI
runs it), not a measurement.
"""

import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

from kvpage import premises
from kvpage.sim import workload as workload_lib

_CONFIG = flags.DEFINE_string("config", "configs/llama_13b.py:bf16", "The model (file).")
_HARDWARE = flags.DEFINE_string("hardware", "h200_141gb", "The simulated device.")
_WORKLOAD = flags.DEFINE_list(
    "workload", ["--num_requests=48", "--arrival_rate=4", "--prompt_len=uniform:64:1024",
                 "--output_len=uniform:16:128"], "serve_bench flags of the workload.")
_SMOKE = flags.DEFINE_bool("smoke", False, "The tiny model on this CPU, a small workload: "
                           "checks the pipeline, measures nothing.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Keep the runs here (default: a temp dir).")
_OUT = flags.DEFINE_string("out", "gpu_fidelity.json", "Where to write the JSON record.")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = dict(config="configs/tiny.py", hardware="cpu",
             workload=["--num_requests=8", "--arrival_rate=8", "--prompt_len=uniform:16:96",
                       "--output_len=uniform:4:16"])


def _run(*argv: str) -> None:
  result = subprocess.run([sys.executable, "-m", "experiments.serve_bench", *argv], cwd=ROOT,
                          capture_output=True, text=True)
  if result.returncode != 0:
    raise SystemExit(f"serve_bench {' '.join(argv)} failed:\n{result.stderr[-3000:]}")


def _read(directory: pathlib.Path) -> dict:
  summary = json.loads((directory / "summary.json").read_text())
  steps = [json.loads(line) for line in (directory / "steps.jsonl").read_text().splitlines()]
  times = sorted(row["step_s"] for row in steps if row.get("step_s"))
  return dict(summary=summary, step_p50=statistics.median(times),
              step_p90=times[int(0.9 * (len(times) - 1))], num_steps=len(times))


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config, hardware, workload = ((SMOKE["config"], SMOKE["hardware"], SMOKE["workload"])
                                if _SMOKE.value else
                                (_CONFIG.value, _HARDWARE.value, _WORKLOAD.value))
  workdir = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="kvpage_gpu_fidelity_"))
  real_dir, sim_dir = workdir / "real", workdir / "sim"
  _run(f"--config={config}", "--executor=jax", "--warmup", f"--workdir={real_dir}",
       f"--compilation_cache={workdir / 'xla_cache'}", *workload)
  real = _read(real_dir)
  num_pages = real["summary"]["pages_total"] + 1  # The pool's reserved null page.
  # The trace holds the workload: the flags it replaces are not given again.
  rest = [flag for flag in workload
          if flag.lstrip("-").split("=")[0] not in workload_lib.TRACE_REPLACES]
  _run(f"--config={config}", "--executor=sim", f"--hardware={hardware}",
       f"--trace={real_dir / 'trace.jsonl'}", f"--num_pages={num_pages}",
       f"--workdir={sim_dir}", *rest)
  sim = _read(sim_dir)

  def figures(run: dict) -> dict[str, float]:
    summary = run["summary"]
    return {"step p50": run["step_p50"], "step p90": run["step_p90"],
            "TTFT p50": summary["ttft_s"]["p50"], "TTFT p90": summary["ttft_s"]["p90"],
            "TPOT p50": summary["tpot_s"]["p50"], "TPOT p90": summary["tpot_s"]["p90"]}

  measured, simulated = figures(real), figures(sim)
  table = [dict(metric=name, measured_s=measured[name], simulated_s=simulated[name],
                error=simulated[name] / measured[name] - 1.0) for name in measured]
  real_premises, sim_premises = real["summary"]["premises"], sim["summary"]["premises"]
  record = dict(
      smoke=_SMOKE.value,
      premises=dict(config=config, model=real_premises["model"]["name"],
                    dtype=real_premises["dtype"], workload=workload, num_pages=num_pages,
                    real_backends=real_premises.get("backends"),
                    simulated_hardware=hardware,
                    step_rates_source=sim_premises["hardware"]["step_rates"]["source"],
                    **premises.environment()),
      steps=dict(real=real["num_steps"], sim=sim["num_steps"]),
      running_batch=dict(real=real["summary"]["running_batch"],
                         sim=sim["summary"]["running_batch"]),
      table=table)
  device = (real_premises.get("backends") or {}).get("device", "this machine")
  print(f"gpu fidelity{' (smoke: pipeline only)' if _SMOKE.value else ''}: {config} on "
        f"{device} against the simulator on {hardware}, one trace "
        f"({' '.join(workload)}), {num_pages} pages")
  print(f"{'metric':<10} {'measured ms':>12} {'simulated ms':>13} {'error':>8}")
  for row in table:
    print(f"{row['metric']:<10} {1e3 * row['measured_s']:>12.2f} "
          f"{1e3 * row['simulated_s']:>13.2f} {100 * row['error']:>+7.1f}%")
  pathlib.Path(_OUT.value).write_text(json.dumps(record, indent=1) + "\n")
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
