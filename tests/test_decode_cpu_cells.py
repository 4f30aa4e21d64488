"""`benchmarks/decode_cpu.py` reads its cells from three flag lists (run as users run it)."""

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")  # the benchmark runs HF generate beside kvpage

ROOT = pathlib.Path(__file__).resolve().parents[1]


def refusal(tmp_path, *flags) -> str:
  """The one line a refused benchmark run ends with (it must not run, nor trace back)."""
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.decode_cpu", *flags, f"--out={tmp_path}/out.json"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
  return result.stderr.strip().splitlines()[-1]


def test_unequal_cell_lists_are_one_clear_error(tmp_path):
  assert "need equal lengths (or one value) without --product; got 2, 3, 1" in refusal(
      tmp_path, "--batch=1,8", "--prompt_len=32,64,128", "--output_len=16")


def test_a_cell_longer_than_the_model_is_refused(tmp_path):
  assert "needs 2,100 positions; tiny has 2,048" in refusal(
      tmp_path, "--batch=1", "--prompt_len=2000", "--output_len=100")
