"""`experiments/capacity.py` end to end: tables, JSON, and one-line errors."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_capacity(*flags: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "experiments.capacity", *flags], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)


def test_report_prints_both_premises_and_figures():
  result = run_capacity("--config=configs/llama_13b.py", "--hardware=a100_80gb")
  assert result.returncode == 0, result.stderr
  out = result.stdout
  for premise in ("llama2_13b", "fp16", "4,096 tokens", "16 tokens per KV page", "a100_80gb",
                  "GB = 10^9 bytes", "nominal", "exact"):
    assert premise in out
  assert "819,200" in out and "3,355,443,200" in out
  last = next(line for line in out.splitlines() if "MAX CONCURRENT REQUESTS" in line)
  assert last.split()[-2:] == ["16", "17"]


def test_json_under_seed_premises():
  result = run_capacity("--memory_gb=80", "--weights_gb=26", "--json")
  assert result.returncode == 0, result.stderr
  record = json.loads(result.stdout)
  assert record["kv_bytes_per_token"] == 819_200
  assert record["kv_bytes_per_request"] == 3_355_443_200
  assert record["weight_bytes"] == 26 * 10**9
  assert record["max_concurrent_requests"] == 16
  assert record["scenarios"]["exact"]["max_concurrent_requests"] == 17


def test_json_gqa_and_binary_units():
  result = run_capacity("--config=configs/llama3_8b.py", "--json", "--units=gib",
                        "--memory_gb=80", "--reserve_gb=2")
  assert result.returncode == 0, result.stderr
  record = json.loads(result.stdout)
  assert record["kv_bytes_per_token"] == 131_072
  assert record["memory_bytes"] == 80 * 2**30 and record["reserve_bytes"] == 2 * 2**30


@pytest.mark.parametrize("flags,message", [
    (["--seq_len=0"], "seq_len must be a positive integer"),
    (["--seq_len=-3"], "seq_len must be a positive integer"),
    (["--dtype=fp7"], "choose one of: fp32, bf16, fp16, fp8, int8"),
    (["--hardware=tpu"],
     "choose one of: a100_40gb, a100_80gb, a100_80gb_pcie, cpu, h100_80gb, h200_141gb"),
    (["--config.model.num_kv_heads=3"], "num_kv_heads=3 must divide num_heads=40"),
    (["--memory_gb=20"], "does not fit"),
    (["--hardware=cpu"], "does not fit"),
    (["--config=configs/llama_13b.py:fp9"], "unknown config variant 'fp9'"),
    (["--config=configs/missing.py"], "cannot load --config"),
    (["--units=mb"], "choose one of: gb, gib"),
])
def test_bad_input_is_one_line_and_nonzero(flags, message):
  result = run_capacity(*flags)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
