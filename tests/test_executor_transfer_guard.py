"""Real runs forbid implicit host<->device transfers; the deliberate ones are explicit.

`JaxExecutor` runs every call under `jax.transfer_guard("disallow")`, so a numpy
array or Python scalar reaching a jitted function on the serving path raises instead
of silently copying. These runs of the tiny model — synchronous, async, multi-step,
and swap preemption — pass only because each transfer they make is explicit: the
batch (`jax.device_put`), the sampled ids (`jax.device_get`) and the swap copies.
A CPU backend shares memory with the host, so it cannot see a device-to-host copy;
host-to-device ones are checked everywhere.
"""

import jax
import numpy as np
import pytest
import tiny_config

from kvpage import build
from kvpage.request import SamplingParams
from models import llama

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(length)]
           for i, length in enumerate([20, 27, 33])]
MAX_TOKENS = 16
RUNS = {  # name -> scheduler overrides, KV pages (null page included)
    "sync": (dict(async_scheduling=False), 64),
    "async": (dict(async_scheduling=True), 64),
    "multi-step": (dict(async_scheduling=True, num_decode_steps=4), 64),
    # 7 usable pages for requests that grow to 10: admission expects one output token,
    # so it overcommits and swapping has to absorb the growth.
    "swap": (dict(preemption_mode="swap", output_estimate="fixed", fixed_output_estimate=1,
                  num_host_pages=16), 8),
}


@pytest.fixture(scope="module")
def params():
  return llama.random_init(tiny_config.get_config().model, seed=0)


def engine_for(params, overrides: dict, num_pages: int):
  config = tiny_config.get_config()
  config.scheduler.update(dict(watermark=0.0, **overrides))
  return build.jax_engine(llama, config.model, params, config.scheduler, num_pages=num_pages,
                          page_size=16, num_host_pages=config.scheduler.num_host_pages)


def spy_on_guard(executor) -> list[str]:
  """Records the host-to-device guard in force at every launch and every page copy."""
  seen = []

  def spied(function):
    def call(*args, **kwargs):
      seen.append(jax.config.jax_transfer_guard_host_to_device)
      return function(*args, **kwargs)
    return call

  executor.step.dispatch = spied(executor.step.dispatch)
  executor.step.dispatch_multi = spied(executor.step.dispatch_multi)
  executor.host_pool._gather = spied(executor.host_pool._gather)
  executor.host_pool._scatter = spied(executor.host_pool._scatter)
  return seen


@pytest.fixture(scope="module")
def reference(params):
  """Greedy tokens of the synchronous run, which every other run must reproduce."""
  engine = engine_for(params, *RUNS["sync"])
  seen = spy_on_guard(engine.executor)
  requests = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
  assert seen and set(seen) == {"disallow"}
  return [r.output_ids for r in requests]


@pytest.mark.parametrize("run", [name for name in RUNS if name != "sync"])
def test_real_runs_make_only_explicit_transfers(params, reference, run):
  engine = engine_for(params, *RUNS[run])
  seen = spy_on_guard(engine.executor)
  requests = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
  assert [r.output_ids for r in requests] == reference
  assert seen and set(seen) == {"disallow"}  # every launch and copy ran guarded
  stats = engine.scheduler.stats()
  if run == "swap":
    assert stats["preemptions"]["swap"] > 0, stats
  if run == "multi-step":
    assert engine.executor.num_launches < len(PROMPTS) * MAX_TOKENS // 2


def test_an_implicit_transfer_on_the_serving_path_raises(params):
  engine = engine_for(params, *RUNS["sync"])
  executor = engine.executor
  # Params left on the host would cross to the device at every step, implicitly.
  executor.params = jax.tree.map(np.asarray, executor.params)
  sampling = SamplingParams(max_tokens=2, ignore_eos=True)
  # The executor's own guard holds even where the caller allows transfers.
  with jax.transfer_guard("allow"), pytest.raises(
      Exception, match="Disallowed host-to-device transfer"):
    engine.generate([[1, 2, 3]], sampling)
  with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
    executor.warmup(1, 8)
