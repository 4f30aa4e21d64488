"""`experiments/generate.py` end to end: JSON lines out, one-line errors for bad input."""

import json
import pathlib
import subprocess
import sys

import pytest
from hf_utils import hf_greedy, make_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]


def generate(*flags: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "experiments.generate", *flags], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def test_generate_from_checkpoint_matches_transformers(tmp_path):
  model = make_checkpoint(tmp_path)
  prompts = [[5, 9, 13], list(range(1, 20))]
  result = generate(f"--checkpoint={tmp_path}", "--prompt_ids=5,9,13;" + ",".join(
      map(str, prompts[1])), "--max_new_tokens=10", "--chunk_size=8", "--page_size=4")
  assert result.returncode == 0, result.stderr
  lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
  assert [line["prompt_ids"] for line in lines] == prompts
  for line, prompt in zip(lines, prompts):
    assert line["output_ids"] == hf_greedy(model, prompt, 10)


def test_generate_random_weights_with_sampling_is_reproducible():
  flags = ("--config=configs/tiny.py", "--config.model.num_layers=2",
           "--prompt_ids=1,2,3;4,5", "--max_new_tokens=6", "--temperature=0.9", "--seed=3")
  first, second = generate(*flags), generate(*flags)
  assert first.returncode == 0, first.stderr
  assert first.stdout == second.stdout and len(first.stdout.splitlines()) == 2


@pytest.mark.parametrize("flags,message", [
    (["--prompt_ids=1,x"], "not a list of comma-separated integers"),
    (["--prompt_ids=1;;2"], "prompt 1 is empty"),
    (["--prompt_ids=1,100000"], "outside the vocabulary"),
    (["--checkpoint=/no/such/dir"], "does not exist"),
    (["--max_new_tokens=0"], "must be > 0"),
    (["--prompt_ids=1", "--max_new_tokens=5000"], "rejected (400)"),
])
def test_bad_input_is_one_line(flags, message):
  result = generate(*flags)
  assert result.returncode != 0 and "Traceback" not in result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and message in last, result.stderr
