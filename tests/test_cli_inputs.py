"""Every bad input to an entry point ends in one `error:` line, exit 2, and no files.

Each example below once ended in a traceback, a misleading message or a run that
should not have started. They run in-process through one worker per entry point
(`cli_harness.Worker`); a few subprocess checks cover what only a fresh process shows.
"""

import json
import pathlib
import subprocess
import sys

import pytest
from cli_harness import ROOT, Worker, assert_one_error_line
from hf_utils import make_checkpoint

SIM = ["--config=configs/tiny.py", "--executor=sim", "--num_requests=4"]


@pytest.fixture(scope="module")
def generate(tmp_path_factory):
  worker = Worker("generate", cache_dir=str(tmp_path_factory.mktemp("jax_cache")))
  yield worker
  worker.close()


@pytest.fixture(scope="module")
def capacity():
  worker = Worker("capacity")
  yield worker
  worker.close()


def write_trace(path: pathlib.Path, *changes: dict) -> pathlib.Path:
  base = dict(request_id="r", arrival_time=0.0, prompt_ids=[1, 2, 3], output_len=4)
  path.write_text("".join(json.dumps({**base, "request_id": f"r{i}", **change}) + "\n"
                          for i, change in enumerate(changes)))
  return path


@pytest.mark.parametrize("flags,message", [
    (["--prompt_len=mix:0.5:inf:1"], "not a finite number"),
    (["--output_len=uniform:1:inf"], "not a finite number"),
    (["--priority=uniform:1:inf"], "not a finite number"),
    (["--arrival_process=gamma:inf"], "not a finite number"),
    (["--arrival_process=gamma:1e-200"], "gamma arrivals need 0.01 <= CV <= 100"),
    (["--arrival_process=gamma:nan"], "spec 'gamma:nan' has a value that is not a finite"),
    (["--priority=123456789012345678901234"], "outside [-2,147,483,647"),
    (["--num_requests=1000000000000"], "num_requests must be in [1, 1,000,000]"),
    (["--prompt_len=100000000000"], "whole number of tokens in [1, 16,777,216]"),
    (["--prompt_len=lognormal:1e300:inf"], "not a finite number"),
    (["--prompt_len=lognormal:1e300:1e301"], "whole number of tokens"),
    (["--prompt_len=uniform:1.5:3"], "whole number of tokens"),
    (["--arrival_rate=1e-300"], "a workload spans at most"),
    (["--arrival_rate=nan"], "arrival rate must be > 0"),
    (["--config.scheduler.nope=1"], "the config has no key 'nope'"),
    (["--config.model.max_seq_len=0"], "model.max_seq_len must be an integer in [1"),
    (["--config.model.norm_eps=-1.0"], "model.norm_eps must be a finite number > 0"),
    (["--config.cache.page_size=0"], "page_size must be an integer in [1"),
    (["--num_pages=1"], "--num_pages must be 0 (auto) or >= 2"),
    (["--num_host_pages=-1"], "--num_host_pages must be >= 0"),
    (["--num_pages=62030830260350"], "cache.num_pages must be an integer in [0, 2,147,483,647]"),
    (["--seed=-1"], "--seed must be in [0, 2**32)"),
    (["--eos_token_id=100000", "--noignore_eos"], "outside the vocabulary"),
    (["--prompt_len=16000000", "--num_requests=4"], "a trace holds at most"),
])
def test_serve_bench_rejects(serve_bench, tmp_path, flags, message):
  argv = [*SIM, f"--workdir={tmp_path}/run", *flags]
  rc, stderr = serve_bench.run(argv)
  assert_one_error_line(rc, stderr, argv)
  assert rc == 2 and message in stderr, stderr
  assert not (tmp_path / "run").exists()  # rejected after the workdir check: nothing left


@pytest.mark.parametrize("change,message", [
    (dict(request_id=[1, 2]), "request_id must be a non-empty string"),
    (dict(request_id={"a": 1}), "request_id must be a non-empty string"),
    (dict(prompt_ids=[True, 2]), "not booleans"),
    (dict(prompt_ids=5), "prompt_ids must be a list"),
    (dict(arrival_time=1e300), "arrival_time must be a finite number of seconds >= 0 and <= 1e+08"),
    (dict(arrival_time=True), "arrival_time must be"),
    (dict(output_len=10**30), "output_len must be an integer >= 1 and <= 16,777,216"),
    (dict(priority=2**40), "priority must be an integer"),
])
def test_trace_lines_are_checked(serve_bench, tmp_path, change, message):
  trace = write_trace(tmp_path / "trace.jsonl", {}, change)
  # The real executor: a trace arrival of 1e300 s once overflowed its wall clock.
  argv = ["--config=configs/tiny.py", f"--trace={trace}", f"--workdir={tmp_path}/run",
          "--nowarmup", "--compilation_cache="]
  rc, stderr = serve_bench.run(argv)
  assert_one_error_line(rc, stderr, argv)
  assert f"{trace}:2: not a trace request" in stderr and message in stderr, stderr


def test_serve_bench_pool_larger_than_memory(serve_bench, tmp_path):
  argv = ["--config=configs/tiny.py", "--num_pages=100000000", f"--workdir={tmp_path}/run",
          "--nowarmup", "--compilation_cache="]
  rc, stderr = serve_bench.run(argv)
  assert_one_error_line(rc, stderr, argv)
  assert "a KV pool of 100,000,000 pages x 16 tokens needs 6,553,600,000,000 bytes" in stderr
  assert "memory" in stderr.split("but the")[1]  # and says how much there is


@pytest.mark.parametrize("flags,message", [
    (["--page_size=100000000"], "a KV pool of 3 pages x 100,000,000 tokens needs"),
    (["--temperature=nan"], "--temperature must be a finite number >= 0"),
    (["--temperature=inf"], "--temperature must be a finite number >= 0"),
    (["--top_p=nan"], "--top_p must be in (0, 1]"),
    (["--seed=-5"], "--seed must be in"),
    (["--prompt_ids=True"], "not a list of comma-separated integers"),
    (["--config.model.max_seq_len=0"], "model.max_seq_len must be an integer"),
    (["--config.scheduler.nope=1"], "the config has no key 'nope'"),
])
def test_generate_rejects(generate, flags, message):
  argv = ["--config=configs/tiny.py", *flags]
  rc, stderr = generate.run(argv)
  assert_one_error_line(rc, stderr, argv)
  assert message in stderr, stderr


@pytest.mark.parametrize("flags,message", [
    (["--memory_gb=inf"], "--memory_gb must be a number in [0, 1,000,000,000] gb, got inf"),
    (["--weights_gb=inf"], "--weights_gb must be a number in [0, 1,000,000,000] gb, got inf"),
    (["--reserve_gb=inf"], "--reserve_gb must be a number in [0, 1,000,000,000] gb, got inf"),
    (["--memory_gb=nan"], "--memory_gb must be a number"),
    (["--memory_gb=1e300"], "--memory_gb must be a number"),
    (["--config.model.max_seq_len=0"], "model.max_seq_len must be an integer"),
])
def test_capacity_rejects(capacity, flags, message):
  argv = ["--config=configs/llama_13b.py", *flags]
  rc, stderr = capacity.run(argv)
  assert_one_error_line(rc, stderr, argv)
  assert message in stderr, stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("checkpoint")
  make_checkpoint(directory, max_shard_size="20KB")
  return directory


def edited_checkpoint(source: pathlib.Path, target: pathlib.Path, file: str,
                      change: dict) -> pathlib.Path:
  target.mkdir()
  for path in source.iterdir():
    (target / path.name).symlink_to(path)
  (target / file).unlink()
  original = json.loads((source / file).read_text())
  (target / file).write_text(json.dumps({**original, **change}))
  return target


@pytest.mark.parametrize("file,change,message", [
    ("model.safetensors.index.json", dict(weight_map=["a", "b"]),
     '"weight_map" must map tensor names to shard file names'),
    ("config.json", dict(rope_parameters="yarn"), '"rope_parameters" must be an object'),
    ("config.json", dict(rope_scaling="yarn"), '"rope_scaling" must be an object'),
    ("config.json", dict(architectures="LlamaForCausalLM"),
     "must be a list of class names, got the string 'LlamaForCausalLM'"),
    ("config.json", dict(max_position_embeddings=1e9),
     "\"max_position_embeddings\" must be an integer, got 1000000000.0"),
    ("config.json", dict(num_attention_heads=0), "num_heads must be an integer in [1"),
    ("config.json", dict(rms_norm_eps="tiny"), "missing or malformed field"),
])
def test_checkpoint_errors(generate, checkpoint, tmp_path, file, change, message):
  directory = edited_checkpoint(checkpoint, tmp_path / "edited", file, change)
  argv = ["--config=configs/tiny.py", f"--checkpoint={directory}", "--prompt_ids=1,2"]
  rc, stderr = generate.run(argv)
  assert_one_error_line(rc, stderr, argv)
  assert message in stderr, stderr


def test_a_billion_positions_allocate_no_table_that_wide(generate, checkpoint, tmp_path):
  directory = edited_checkpoint(checkpoint, tmp_path / "edited", "config.json",
                                dict(max_position_embeddings=10**9))
  argv = ["--config=configs/tiny.py", f"--checkpoint={directory}", "--prompt_ids=1,2",
          "--max_new_tokens=3"]
  rc, stderr = generate.run(argv)
  assert rc == 0, stderr


def test_one_line_from_a_fresh_process_without_backend_probe_noise(tmp_path):
  """The real thing: no worker, absl's own start-up, jax's backend probing."""
  for module, flags in (("generate", ["--temperature=nan"]),
                        ("serve_bench", ["--config.scheduler.nope=1"]),
                        ("capacity", ["--memory_gb=inf"])):
    result = subprocess.run([sys.executable, "-m", f"experiments.{module}", *flags], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert_one_error_line(result.returncode, result.stderr, flags)
    assert result.returncode == 2
  result = subprocess.run([sys.executable, "-m", "experiments.generate", "--max_new_tokens=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and "Unable to initialize backend" not in result.stderr
