"""A real run's tokens do not depend on preemption: recompute and swap reproduce generate.py."""

import json
import pathlib
import subprocess
import sys

import pytest
import tiny_config

from kvpage import build
from kvpage.request import SamplingParams
from models import llama

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = [[(5 * i + 3 * j) % 500 + 1 for j in range(length)]
           for i, length in enumerate([20, 33, 27, 40])]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference_outputs():
  """What experiments/generate.py prints for the same prompts (random tiny weights, greedy)."""
  result = subprocess.run(
      [sys.executable, "-m", "experiments.generate", "--config=configs/tiny.py",
       f"--config.model.num_layers={tiny_config.NUM_LAYERS}",
       "--prompt_ids=" + ";".join(",".join(map(str, p)) for p in PROMPTS),
       f"--max_new_tokens={MAX_TOKENS}", "--page_size=16"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  return [json.loads(line)["output_ids"] for line in result.stdout.strip().splitlines()]


@pytest.mark.parametrize("num_decode_steps", [1, 8], ids=["1-step", "8-step"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_run_matches_generate(reference_outputs, mode, async_scheduling,
                                        num_decode_steps):
  config = tiny_config.get_config()
  # 11 usable pages for four requests that grow to 15 pages; admission is told to
  # expect one output token, so it overcommits and preemption has to absorb the growth.
  config.scheduler.update(dict(preemption_mode=mode, watermark=0.0, output_estimate="fixed",
                               fixed_output_estimate=1, num_host_pages=32,
                               async_scheduling=async_scheduling,
                               num_decode_steps=num_decode_steps))
  params = llama.random_init(config.model, config.seed)
  engine = build.jax_engine(llama, config.model, params, config.scheduler, num_pages=12,
                            page_size=16, num_host_pages=32)
  requests = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
  stats = engine.scheduler.stats()
  assert stats["preemptions"][mode] > 0, stats
  assert [r.output_ids for r in requests] == reference_outputs
  assert all(r.finish_reason == "length" for r in requests)
  assert stats["num_free_pages"] == 11 and stats["num_free_host_pages"] == 32
