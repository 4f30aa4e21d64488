"""One memory plan sizes real and simulated KV pools: fraction x device - weights - activations.

A real run measures its terms (the weights' bytes, XLA's temporaries for the largest
steps); a simulated run computes them from the same shapes. The estimate is held to
the measurement here, so the two kinds of run plan alike.
"""

import json

import pytest

from configs import base, llama2_70b, llama_13b, tiny
from configs import hardware as hardware_lib
from experiments import cli
from kvpage import memory_plan, model_shape, sizing
from kvpage.device import backends
from kvpage.device.backends.xla import attention as xla
from kvpage.interface import CostTraits
from models import llama

A100 = hardware_lib.get_hardware("a100_80gb")


def planned_tiny(**model):
  """The tiny config with no page count and no budget (the plan sizes its pool), on two
  layers (temporaries are one layer's at a time; half the compile time)."""
  config = tiny.get_config()
  config.cache.num_pages, config.cache.kv_memory_gib = 0, 0.0
  config.model.num_layers = 2
  config.model.update(model)
  return config


def estimated(config) -> int:
  model = model_shape.ModelShape.from_config(config.model)
  return max(memory_plan.step_activation_bytes(
      model, num_tokens=tokens, num_seqs=seqs, dtype=config.model.dtype,
      traits=backends.traits(config.model))
             for tokens, seqs, _ in sizing.largest_steps(config))


def test_the_estimate_takes_the_backends_tiles_and_refuses_traits_without_them():
  config = planned_tiny()
  traits = backends.traits(config.model)
  assert (traits.decode_tokens_per_tile, traits.prefill_query_block,
          traits.prefill_tokens_per_tile) == (xla.DECODE_TOKENS_PER_TILE,
                                              xla.PREFILL_QUERY_BLOCK,
                                              xla.PREFILL_TOKENS_PER_TILE)
  shape = model_shape.ModelShape.from_config(config.model)
  with pytest.raises(ValueError, match="without attention tiles"):
    memory_plan.step_activation_bytes(shape, num_tokens=64, num_seqs=4, dtype="fp32",
                                      traits=CostTraits())


@pytest.mark.parametrize("model,limits", [
    ({}, {}),  # tiny: d_model 256, a 2,048-token mixed step is the largest
    (dict(d_model=512, ffn_dim=1536, num_heads=8, vocab_size=4096),  # wider; decode-bound
     dict(max_num_seqs=256, max_num_batched_tokens=512)),
])
def test_the_simulators_estimate_tracks_the_measured_activations(model, limits):
  config = planned_tiny(**model)
  config.scheduler.update(limits)
  measured = sizing.real_memory_plan(llama, config, config.model).activation_bytes
  assert 1 / 1.5 <= estimated(config) / measured <= 1.5, (estimated(config), measured)


def test_a_real_run_sizes_its_pool_by_the_plan(monkeypatch):
  # On CPU the device is the host's available memory, which moves between two reads
  # while other processes run (531,843 vs 531,850 pages on one CI run): pin it.
  monkeypatch.setattr(sizing, "device_memory_limit", lambda: (8 << 30, "host memory available"))
  config = planned_tiny()
  plan = sizing.real_memory_plan(llama, config, config.model)
  shape = model_shape.ModelShape.from_config(config.model)
  assert plan.weight_bytes == model_shape.weight_bytes(shape, "fp32")  # the params' own bytes
  assert plan.activation_bytes > 0 and "measured" in plan.activation_source
  page = 2 * 4 * 2 * 2 * 64 * 16  # K and V, fp32, 2 layers, 2 KV heads, head_dim 64, 16 tokens
  assert plan.page_bytes == page
  free = int(0.9 * plan.device_bytes) - plan.weight_bytes - plan.activation_bytes
  assert plan.num_pages == free // page
  pages, reason, got = sizing.real_pool_pages(llama, config, config.model)
  assert (pages, reason) == (min(plan.num_pages, sizing.MAX_PAGES), "the memory plan")
  assert got is not None and got.activation_bytes == plan.activation_bytes
  # Half the device: half the usable bytes, the same weights and activations.
  config.cache.memory_utilization = 0.45
  half = sizing.real_memory_plan(llama, config, config.model)
  assert half.usable_bytes == int(0.45 * half.device_bytes)
  assert (half.weight_bytes, half.activation_bytes) == (plan.weight_bytes, plan.activation_bytes)
  # What the workload can hold at once caps the plan, as it caps a byte budget.
  setup = cli.serving_engine(config, executor="jax", hardware=A100, pages_needed=40)
  assert setup.num_pages == 40 and setup.memory_plan is not None
  assert "the memory plan; the workload needs at most 40" in setup.pool_reason


def test_a_simulated_run_plans_from_the_models_shapes():
  config = llama_13b.get_config()
  plan = sizing.sim_memory_plan(config, A100)
  shape = model_shape.ModelShape.from_config(config.model)
  assert plan.device_bytes == A100.memory_bytes and plan.utilization == 0.9
  assert plan.weight_bytes == model_shape.weight_bytes(shape, "fp16")
  assert plan.activation_bytes == estimated(config)
  assert plan.num_pages == plan.kv_pool_bytes // plan.page_bytes
  setup = cli.serving_engine(config, executor="sim", hardware=A100)
  assert setup.num_pages == plan.num_pages and setup.memory_plan == plan
  lines = "\n".join(plan.lines())
  assert "- 24.24 GiB weights (from the model's shapes)" in lines
  assert f"= {plan.kv_pool_bytes / 2**30:,.2f} GiB KV pool: {plan.num_pages:,} pages" in lines
  # Tensor parallel 2: each device holds half the weights and half of every page.
  config.mesh.tensor_parallel = 2
  split = sizing.sim_memory_plan(config, A100)
  assert split.weight_bytes == -(-plan.weight_bytes // 2)
  assert split.page_bytes == plan.page_bytes // 2
  assert split.num_pages > 2 * plan.num_pages  # the weights' half freed room for pages too
  # A given page count is taken as it is.
  config.cache.num_pages = 99
  assert cli.serving_engine(config, executor="sim", hardware=A100).num_pages == 99


def test_a_plan_with_no_room_says_which_terms_took_it():
  config = llama2_70b.get_config()
  config.mesh.tensor_parallel = 1  # 129 GiB of fp16 weights on one 80 GiB device
  with pytest.raises(ValueError, match=r"no room for a KV pool: 0\.9 x a100_80gb memory "
                                       r"80\.00 GiB = 72\.00 GiB, minus weights 128\.\d+ GiB"):
    sizing.sim_memory_plan(config, A100)


@pytest.mark.parametrize("utilization", [0.0, 1.5, -0.1])
def test_a_utilization_outside_zero_to_one_is_refused(utilization):
  config = tiny.get_config()
  config.cache.memory_utilization = utilization
  with pytest.raises(ValueError, match=r"cache\.memory_utilization"):
    base.check(config)


def test_a_plan_round_trips_through_its_record():
  plan = sizing.sim_memory_plan(llama_13b.get_config(), A100)
  record = json.loads(json.dumps(plan.to_dict()))  # as summary.json keeps it
  assert memory_plan.MemoryPlan.from_dict(record) == plan
  assert record["num_pages"] == plan.num_pages
