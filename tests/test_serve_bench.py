"""`experiments/serve_bench.py`, the main job, end to end."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
from serve_utils import make_served_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]
REQUIRED = ("num_requests", "num_admitted", "num_finished", "rejections", "num_preemptions",
            "max_kv_usage", "pages_total", "pages_free_at_end", "ttft_s", "tpot_s",
            "prompt_tokens_per_s", "output_tokens_per_s", "running_batch", "premises")


# Real runs of the tiny config with two of its four layers (tests/tiny_config.py says why).
TWO_LAYERS = "--config.model.num_layers=2"


def serve(workdir, *flags):
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", f"{workdir}/cache")  # tests/conftest.py
  return subprocess.run(
      [sys.executable, "-m", "experiments.serve_bench", f"--workdir={workdir}",
       f"--compilation_cache={cache}", *flags],
      cwd=ROOT, capture_output=True, text=True, timeout=600)


def check_summary(workdir) -> dict:
  summary = json.loads((workdir / "summary.json").read_text())
  for key in REQUIRED:
    assert key in summary, key
  for key in ("ttft_s", "tpot_s"):
    assert {"p50", "p99"} <= set(summary[key])
  assert 0 <= summary["max_kv_usage"] <= 1
  assert summary["pages_free_at_end"] == summary["pages_total"]
  premises = summary["premises"]
  for key in ("model", "dtype", "workload", "policies", "hardware", "packages", "seed"):
    assert key in premises, key
  steps = (workdir / "steps.jsonl").read_text().splitlines()
  assert len(steps) == summary["num_steps"] > 0
  assert len((workdir / "trace.jsonl").read_text().splitlines()) == summary["num_requests"]
  return summary


def test_simulated_13b(tmp_path):
  result = serve(tmp_path, "--executor=sim", "--config=configs/llama_13b.py",
                 "--hardware=a100_80gb", "--num_requests=60", "--arrival_rate=8",
                 "--prompt_len=mix:0.1:3000:200", "--output_len=uniform:32:256")
  assert result.returncode == 0, result.stderr
  summary = check_summary(tmp_path)
  assert summary["premises"]["hardware"]["name"] == "a100_80gb"
  assert summary["num_finished"] == summary["num_admitted"] > 0
  assert "TTFT" in result.stdout and "a100_80gb" in result.stdout
  assert summary["running_batch"]["mean"] > 0 and "running batch" in result.stdout


def serve_six_tiny_requests(tmp_path, output_len: int, *flags) -> tuple[dict, list[dict]]:
  """A real run of six requests at once; returns the summary and the step rows."""
  result = serve(tmp_path, TWO_LAYERS, "--num_requests=6", "--arrival_rate=inf",
                 "--prompt_len=uniform:4:30", f"--output_len={output_len}", *flags)
  assert result.returncode == 0, result.stderr
  summary = check_summary(tmp_path)
  assert summary["num_finished"] == summary["num_admitted"] == 6
  rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
  assert all(row["output_tokens"] == output_len for row in rows)
  steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
  assert sum(step["generated_tokens"] for step in steps) == 6 * output_len
  return summary, steps


def test_real_tiny_model(tmp_path):
  summary, _ = serve_six_tiny_requests(tmp_path, 4, "--nowarmup", "--prefill_policy=none")
  assert summary["premises"]["policies"]["prefill_policy"] == "none"


def test_real_tiny_model_with_multi_step_decoding(tmp_path):
  # A small budget keeps the warm-up to a few shapes; it still compiles all of them.
  summary, steps = serve_six_tiny_requests(tmp_path, 9, "--num_decode_steps=4",
                                           "--max_num_seqs=8", "--max_num_batched_tokens=64")
  assert summary["premises"]["policies"]["num_decode_steps"] == 4
  assert summary["premises"]["compiles_during_run"] == 0  # multi-step ones too
  assert max(step["generated_tokens"] for step in steps) > 6  # some launch ran iterations


@pytest.mark.parametrize("flags,message", [
    (["--executor=gpu"], "value should be one of"),
    (["--prompt_len=zipf:1"], "unknown length spec"),
    (["--arrival_rate=fast"], "not a number or inf"),
    (["--executor=sim", "--checkpoint=/tmp"], "needs --executor=jax"),
    (["--executor=sim", "--hardware=tpu"], "unknown hardware"),
    (["--executor=sim", "--preemption_mode=evict"], "unknown scheduler.preemption_mode"),
    (["--executor=sim", "--max_num_seqs=lots"], "must be of type int"),
    (["--executor=sim", "--num_decode_steps=0"], "num_decode_steps must be an integer >= 1"),
])
def test_bad_flags_are_one_line_errors(tmp_path, flags, message):
  result = serve(tmp_path, *flags)
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert message in result.stderr.strip().splitlines()[-1], result.stderr


def test_unusable_inputs_fail_before_the_run(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  cases = [
      ([f"--workdir={blocker}/sub", "--executor=sim"], "not a writable directory"),
      (["--executor=sim", f"--trace={tmp_path}/missing.jsonl"], "No such file"),
      (["--executor=sim", "--slo_ttft=-1"], "must be > 0 seconds"),
      (["--executor=sim", "--page_size=0"], "--page_size must be a positive"),
  ]
  for flags, message in cases:
    result = subprocess.run(
        [sys.executable, "-m", "experiments.serve_bench", f"--workdir={tmp_path}/w",
         "--compilation_cache=", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr.strip().splitlines()[-1], result.stderr


def test_measured_clock_starts_after_warmup(tmp_path):
  result = serve(tmp_path, TWO_LAYERS, "--num_requests=4", "--arrival_rate=inf", "--prompt_len=8",
                 "--output_len=2", "--max_num_seqs=8", "--max_num_batched_tokens=256")
  assert result.returncode == 0, result.stderr
  summary = check_summary(tmp_path)
  assert summary["premises"]["compiles_during_run"] == 0  # warm-up compiled every shape
  first = json.loads((tmp_path / "steps.jsonl").read_text().splitlines()[0])
  assert first["time"] < 2.0  # not the seconds that compilation took


def test_a_checkpoint_run_sizes_its_pool_to_the_work(tmp_path):
  # The tiny config's 256 pages are sized for its own model; a checkpoint's pool comes
  # from the byte budget (cache.kv_memory_gib), capped by what the 64 requests hold.
  checkpoint = make_served_checkpoint(tmp_path / "checkpoint")
  workdir = tmp_path / "run"
  result = serve(workdir, f"--checkpoint={checkpoint}", "--num_requests=64",
                 "--arrival_rate=inf", "--prompt_len=uniform:4:40", "--output_len=2",
                 "--nowarmup")
  assert result.returncode == 0, result.stderr
  summary = check_summary(workdir)
  trace = [json.loads(line) for line in (workdir / "trace.jsonl").read_text().splitlines()]
  held = sum(-(-(len(item["prompt_ids"]) + 2) // 16) for item in trace)
  needed = 1 + math.ceil(held / (1 - 0.15))  # above the default 15% watermark
  assert summary["pages_total"] == needed - 1  # the null page holds nothing
  assert summary["num_finished"] == summary["num_admitted"] == 64
  assert not any(summary["rejections"].values())
  reason = summary["premises"]["pool_reason"]
  assert "cache.kv_memory_gib=4 GiB" in reason and f"needs at most {needed}" in reason
  assert reason in result.stdout
