"""The GPU fidelity benchmark's pipeline, in its CPU smoke mode: a real run, the simulator
on the very trace it wrote, the same pool, and a side-by-side record."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_smoke_mode_replays_the_real_runs_trace_in_the_simulator(tmp_path):
  out = tmp_path / "smoke.json"
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.gpu_fidelity", "--smoke", f"--out={out}",
       f"--workdir={tmp_path / 'runs'}"], cwd=ROOT, capture_output=True, text=True,
      timeout=600)
  assert result.returncode == 0, result.stderr
  record = json.loads(out.read_text())
  assert record["smoke"] is True
  assert [row["metric"] for row in record["table"]] == [
      "step p50", "step p90", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"]
  for row in record["table"]:
    assert row["measured_s"] > 0 and row["simulated_s"] > 0, row
    assert row["error"] == row["simulated_s"] / row["measured_s"] - 1.0
  assert record["premises"]["simulated_hardware"] == "cpu"
  # The simulator replayed the real run's requests: the same trace, the same pool.
  real, sim = (tmp_path / "runs" / name for name in ("real", "sim"))
  assert (json.loads((real / "summary.json").read_text())["pages_total"]
          == json.loads((sim / "summary.json").read_text())["pages_total"]
          == record["premises"]["num_pages"] - 1)  # Less the null page.
  requests = {name: sorted((r["arrival_time"], r["prompt_ids"], r["output_len"]) for r in map(
      json.loads, (run / "trace.jsonl").read_text().splitlines()))
      for name, run in (("real", real), ("sim", sim))}
  assert requests["real"] == requests["sim"] and len(requests["real"]) == 8
  assert "TPOT p50" in result.stdout and "wrote" in result.stdout
