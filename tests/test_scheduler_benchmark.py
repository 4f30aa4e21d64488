"""`benchmarks/scheduler_overhead.py` end to end on a small load: table, JSON, premises."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_benchmark_writes_median_and_p99_with_premises(tmp_path):
  out = tmp_path / "overhead.json"
  result = subprocess.run(
      [sys.executable, "benchmarks/scheduler_overhead.py", f"--out={out}", "--num_running=8",
       "--num_waiting=20", "--num_steps=20", "--num_warmup=2", "--max_tokens=64"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "8 running + 20 waiting" in result.stdout and "python" in result.stdout
  record = json.loads(out.read_text())
  assert 0 < record["median_ms"] <= record["p99_ms"]
  assert record["premises"]["scheduler"]["max_num_seqs"] == 8
  assert record["premises"]["python"] == sys.version.split()[0]
