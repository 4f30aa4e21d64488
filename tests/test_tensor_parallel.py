"""Tensor parallelism on 4 CPU devices: the same tokens as one device, 1/N of the bytes.

The suite's own process has one device (`jax` fixes the count when it starts), so
`test_on_four_devices` runs this module again in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`, where the other tests run (and
this one skips). Multi-process runs (`jax.distributed` on 127.0.0.1, gloo collectives)
are launched from there too.
"""

import collections
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import serve_utils
import tiny_config

from kvpage import batch as batch_lib
from kvpage import build, sizing
from kvpage.device import sharding
from kvpage.request import SamplingParams
from models import hf, llama

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUM_DEVICES = 4
four_devices = pytest.mark.skipif(jax.device_count() < NUM_DEVICES,
                                  reason="runs in test_on_four_devices' subprocess")
PROMPTS = [[(7 * i + 3 * j) % 300 + 1 for j in range(length)]
           for i, length in enumerate([21, 34, 9, 40])]


def _env(num_devices: int) -> dict[str, str]:
  return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}",
              JAX_PLATFORMS="cpu")


@pytest.mark.skipif(jax.device_count() >= NUM_DEVICES, reason="this is the subprocess")
def test_on_four_devices():
  result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0",
                           "-o", "addopts=",
                           "-q", str(pathlib.Path(__file__).relative_to(ROOT))],
                          cwd=ROOT, env=_env(NUM_DEVICES), capture_output=True, text=True,
                          timeout=1500)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert " passed" in result.stdout and " skipped" in result.stdout, result.stdout[-2000:]
  assert "failed" not in result.stdout


def _engine(model, params, tensor_parallel, *, num_pages=64, **scheduler):
  config = tiny_config.get_config()
  config.scheduler.update(scheduler)
  return build.jax_engine(llama, model, params, config.scheduler, num_pages=num_pages, page_size=16,
                          num_host_pages=config.scheduler.num_host_pages,
                          tensor_parallel=tensor_parallel)


def _greedy(engine, prompts=PROMPTS, max_tokens=20):
  requests = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
  return [request.output_ids for request in requests]


# Chunked prefill, 4-step decoding and swap preemption at once: 11 usable pages for
# four requests that grow to 12; admission expects one output token, so it overcommits
# and preemption by swap has to absorb the growth (host copies of sharded pages).
PRESSURE = dict(prefill_policy="chunked", chunk_size=8, num_decode_steps=4,
                preemption_mode="swap", watermark=0.0, output_estimate="fixed",
                fixed_output_estimate=1, num_host_pages=32)


@four_devices
def test_tiny_model_tokens_equal_one_device_under_chunking_multi_step_and_swap():
  model = tiny_config.get_config().model
  params = llama.random_init(model, seed=0)
  outputs = {}
  for tp in (1, 2, 4):  # at 4, the tiny model's 2 KV heads are each replicated twice
    engine = _engine(model, params, tp, num_pages=12, **PRESSURE)
    outputs[tp] = _greedy(engine)
    stats = engine.scheduler.stats()
    assert stats["preemptions"]["swap"] > 0, stats
    assert stats["num_free_pages"] == 11 and stats["num_free_host_pages"] == 32
  assert outputs[2] == outputs[1] and outputs[4] == outputs[1]


@four_devices
def test_gqa_checkpoint_with_fewer_kv_heads_than_devices(tmp_path):
  directory = serve_utils.make_served_checkpoint(tmp_path / "ckpt", vocab_size=384)
  model, params = hf.load(directory)
  assert (model.num_heads, model.num_kv_heads) == (4, 2)
  prompts = [[(5 * i + j) % 380 + 1 for j in range(n)] for i, n in enumerate([13, 30, 7])]
  outputs = {tp: _greedy(_engine(model, params, tp, prefill_policy="chunked", chunk_size=16),
                         prompts)
             for tp in (1, 4)}  # (an even split of its heads: the test above)
  assert outputs[4] == outputs[1]


@four_devices
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_every_attention_implementation_runs_per_shard(impl):
  model = tiny_config.get_config().model
  model.attention_impl = impl
  params = llama.random_init(model, seed=0)
  prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2]]
  one = _greedy(_engine(model, params, 1, prefill_policy="chunked", chunk_size=8), prompts, 6)
  four = _greedy(_engine(model, params, 4, prefill_policy="chunked", chunk_size=8), prompts, 6)
  assert four == one


def _norm_bytes(params):
  return sum(leaf.nbytes for path, leaf in jax.tree_util.tree_leaves_with_path(params)
             if llama.param_axes(tuple(str(key.key) for key in path)) == (None,))


def _kv_bytes(params):
  return sum(leaf.nbytes for path, leaf in jax.tree_util.tree_leaves_with_path(params)
             if "kv_heads" in llama.param_axes(tuple(str(key.key) for key in path)))


@four_devices
@pytest.mark.parametrize("tp", [2, 4])
def test_each_device_holds_its_share_of_weights_and_cache(tp):
  model = tiny_config.get_config().model  # 4 query heads, 2 KV heads
  params = llama.random_init(model, seed=0)
  total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
  norms, kv = _norm_bytes(params), _kv_bytes(params)
  engine = _engine(model, params, tp)
  executor = engine.executor
  kv_groups = min(model.num_kv_heads, tp)
  # Split 1/tp: everything but the norm scales (whole by design) and, past 2 devices,
  # the K/V projections, split over the 2 KV-head groups and replicated within each.
  expected = (total - norms - kv) // tp + kv // kv_groups + norms
  held = sharding.device_bytes(executor.params)
  assert len(held) == tp and set(held.values()) == {expected}, (held, expected)
  cache = executor.cache
  cache_held = sharding.device_bytes(cache)
  assert set(cache_held.values()) == {cache.num_bytes // kv_groups}
  for leaf in (cache.k_pages, cache.v_pages):
    assert leaf.sharding.shard_shape(leaf.shape)[1] == model.num_kv_heads // kv_groups


@four_devices
def test_the_step_all_reduces_twice_per_layer_and_gathers_only_logits():
  model = tiny_config.get_config().model
  engine = _engine(model, llama.random_init(model, seed=0), NUM_DEVICES)
  executor = engine.executor
  tp = executor.tensor_parallel
  for decode_only, (num_tokens, num_seqs) in ((True, (8, 8)), (False, (64, 8))):
    batch = batch_lib.example_batch(num_tokens, num_seqs, 8, decode_only=decode_only)
    packed, layout = batch_lib.pack(batch)
    whole = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=tp.replicated)
             for x in (packed, np.zeros(executor.step.feed_width, np.int32))]
    text = executor.step._jitted.lower(executor.params, executor.cache, *whole, layout=layout,
                                       all_greedy=True).compile().as_text()
    ops = collections.Counter(re.findall(
        r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
        r"(?:-start)?\(", text))
    kinds = collections.Counter(kind for _, kind in ops.elements())
    # Two per layer (after o_proj and down_proj) and one for the vocabulary-split
    # embedding lookup; the one gather is the sampled rows' logits, never weights or pages.
    assert kinds == {"all-reduce": 2 * model.num_layers + 1, "all-gather": 1}, ops
    assert ops[(f"f32[{num_seqs},{model.vocab_size}]{{0,1}}", "all-gather")] == 1, ops


_BACKEND_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: _BACKEND_COMPILES.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)


@four_devices
def test_steady_state_never_recompiles_on_a_mesh():
  model = tiny_config.get_config().model
  engine = _engine(model, llama.random_init(model, seed=0), NUM_DEVICES, num_host_pages=8,
                   preemption_mode="swap")
  _greedy(engine, [[1 + i, 2, 3, 4 + i] for i in range(5)], 12)
  compiles, backend = engine.executor.num_compiles, len(_BACKEND_COMPILES)
  _greedy(engine, [[9, 8, 7, 6]] * 5, 12)  # the same buckets
  assert engine.executor.num_compiles == compiles
  assert len(_BACKEND_COMPILES) == backend


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def _generate_outputs(stdout: str) -> list[list[int]]:
  # gloo prints its connection lines on stdout too; the outputs are the JSON lines.
  return [json.loads(line)["output_ids"] for line in stdout.splitlines()
          if line.startswith("{")]


@four_devices
def test_two_processes_of_two_devices_equal_one_process_of_four():
  flags = ["-m", "experiments.generate", "--config=configs/tiny.py",
           f"--config.model.num_layers={tiny_config.NUM_LAYERS}", "--tensor_parallel=4",
           "--chunk_size=8", "--max_new_tokens=12",
           "--prompt_ids=" + ";".join(",".join(map(str, p)) for p in PROMPTS)]
  single = subprocess.run([sys.executable, *flags], cwd=ROOT, env=_env(4),
                          capture_output=True, text=True, timeout=300)
  assert single.returncode == 0, single.stderr[-3000:]
  cluster = [f"--coordinator_address=127.0.0.1:{_free_port()}", "--num_processes=2"]
  processes = [subprocess.Popen([sys.executable, *flags, *cluster, f"--process_id={i}"],
                                cwd=ROOT, env=_env(2), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in (0, 1)]
  try:
    results = [process.communicate(timeout=300) for process in processes]
  finally:
    for process in processes:
      process.kill()
  for process, (_, stderr) in zip(processes, results):
    assert process.returncode == 0, stderr[-3000:]
  expected = _generate_outputs(single.stdout)
  assert len(expected) == len(PROMPTS) and all(len(ids) == 12 for ids in expected)
  assert _generate_outputs(results[0][0]) == expected
  assert _generate_outputs(results[1][0]) == []  # process 1 only steps


def test_shapes_that_cannot_split_are_refused_before_anything_runs():
  config = tiny_config.get_config()  # 4 query heads, 2 KV heads, FFN 512
  config.mesh.tensor_parallel = 3
  with pytest.raises(ValueError, match="num_heads=4 does not split over tensor_parallel=3"):
    sizing.check_runnable(config)
  result = subprocess.run(
      [sys.executable, "-m", "experiments.generate", "--config=configs/tiny.py",
       "--tensor_parallel=8"], cwd=ROOT, env=_env(8), capture_output=True, text=True,
      timeout=120)
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert "num_heads=4 does not split over tensor_parallel=8" in result.stderr


@four_devices
def test_the_real_memory_plan_is_one_devices():
  config = tiny_config.get_config()
  config.mesh.tensor_parallel = 2
  plan = sizing.real_memory_plan(llama, config, config.model)
  engine = _engine(config.model, llama.random_init(config.model, seed=0), 2)
  held = sharding.device_bytes(engine.executor.params)
  assert set(held.values()) == {plan.weight_bytes}
  cache = engine.executor.cache
  assert plan.page_bytes == cache.num_bytes // cache.num_pages // 2
