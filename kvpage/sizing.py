"""Sizing a run before anything is allocated: memory checks, memory plans, pool pages.

A real run's KV pool is sized from the device (`real_memory_plan`: JAX's memory limit,
the weights' own bytes, the temporaries XLA assigns the compiled largest steps), from a
byte budget, or from a page count; a simulated run's from the hardware entry's memory
(`sim_memory_plan`), with the activations estimated at the same step shapes from the
backend's cost traits (`kvpage.memory_plan`). `check_memory` refuses, in one line, a
pool and weights that cannot fit, before XLA would fail deep inside an allocation.
"""

import functools
import math
from typing import Any

import jax
import ml_collections

from kvpage import batch as batch_lib
from kvpage import memory_plan, model_shape, premises
from kvpage.device import backends, sharding
from kvpage.device import cache as paged_cache
from kvpage.device import step as step_lib
from kvpage.memory_plan import MemoryPlan
from kvpage.sim.hardware import HardwareSpec
from kvpage.units import cdiv

MAX_PAGES = 2**24  # pages in one pool: 268M tokens at 16 per page
HOST_SHARE = 0.5  # of the host's available memory, the most a byte-budget pool takes


def _gib(num_bytes: float) -> str:
  return f"{num_bytes:,.0f} bytes ({num_bytes / 2**30:,.2f} GiB)"


def _device_stats() -> tuple[Any, dict]:
  device = jax.devices()[0]
  try:
    return device, device.memory_stats() or {}
  except Exception:  # backends without memory statistics raise errors of their own
    return device, {}


def device_memory() -> tuple[int | None, str]:
  """Bytes the first device can still allocate, and what they are.

  An accelerator reports its own limit; the CPU backend reports none, and its arrays
  live in host memory, so the host's available memory stands in.
  """
  device, stats = _device_stats()
  if "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"{device.platform} memory"
  return premises.available_memory_bytes(), "host memory available"


def check_memory(model_config: ml_collections.ConfigDict, *, num_pages: int, page_size: int,
                 kv_dtype: str | None = None, num_host_pages: int = 0,
                 weights_loaded: bool = False, tensor_parallel: int = 1,
                 hint: str = "lower --num_pages or --page_size") -> None:
  """Raises a one-line `ValueError` if the weights and the KV pool cannot fit, up front.

  Asking XLA for more than there is fails deep inside an allocation, or gets the
  process killed; the sizes are known before anything is allocated, so say them.
  `weights_loaded`: the weights already sit on the device (a loaded checkpoint).
  Under `tensor_parallel` the figures are one device's: its KV heads' slice of the
  pool and its share of the weights; the host swap pool holds whole pages.
  """
  whole = paged_cache.pool_bytes(model_config, num_pages=num_pages, page_size=page_size,
                                 dtype=kv_dtype)
  model = model_shape.ModelShape.from_config(model_config)
  kv = whole // model.num_kv_heads * model_shape.kv_heads_per_device(model, tensor_parallel)
  weights = 0 if weights_loaded else cdiv(model_shape.weight_bytes(model, model_config.dtype),
                                          tensor_parallel)
  available, what = device_memory()
  if available is not None and weights + kv > available:
    one = " on one of its devices" if tensor_parallel > 1 else ""
    raise ValueError(f"a KV pool of {num_pages:,} pages x {page_size:,} tokens needs "
                     f"{_gib(kv)} and the weights {_gib(weights)}{one}, but the {what} is "
                     f"{_gib(available)}; {hint}")
  host = whole // max(num_pages, 1) * num_host_pages
  host_available = premises.available_memory_bytes()
  if num_host_pages and host_available is not None and host > host_available:
    raise ValueError(f"a host swap pool of {num_host_pages:,} pages needs {_gib(host)}, but "
                     f"the host memory available is {_gib(host_available)}")


def max_model_len(model_config: ml_collections.ConfigDict, *, num_pages: int,
                  page_size: int) -> int:
  """The longest sequence served: the model's context, capped by what the pool holds.

  No sequence can outgrow the pool anyway, and the batch's page tables are as wide
  as this length allows, so a checkpoint declaring a billion positions must not make
  them a billion wide.
  """
  return min(model_config.max_seq_len, (num_pages - 1) * page_size)


def largest_steps(config: ml_collections.ConfigDict) -> list[tuple[int, int, bool]]:
  """`(tokens, seqs, decode_only)` of the largest steps `config`'s scheduler can build,
  padded as a served step is (`Buckets.for_server`): a decode of `max_num_seqs`
  sequences and a mixed step of `max_num_batched_tokens`. The memory plan reserves
  what the larger needs, measured (real runs) or estimated (simulated) at these shapes."""
  limits = config.scheduler
  buckets = batch_lib.Buckets.for_server(max_model_len=config.model.max_seq_len,
                                         page_size=config.cache.page_size,
                                         max_num_seqs=limits.max_num_seqs)
  tokens = limits.max_num_batched_tokens
  mixed = (buckets.mixed_shape(tokens, 1) if tokens <= batch_lib.TOKEN_BUCKETS[-1]
           else (tokens, buckets.mixed_num_seqs))  # past the ladder: only a simulator runs it
  return [(*buckets.decode_shape(limits.max_num_seqs), True), (*mixed, False)]


def _steps_label(shapes: list[tuple[int, int, bool]]) -> str:
  return " and ".join(f"{'decode' if decode else 'mixed'} {tokens:,} tokens x {seqs} seqs"
                      for tokens, seqs, decode in shapes)


def _utilization(config: ml_collections.ConfigDict) -> float:
  return config.cache.get("memory_utilization", memory_plan.DEFAULT_UTILIZATION)


def sim_memory_plan(config: ml_collections.ConfigDict,
                    hardware: HardwareSpec) -> MemoryPlan:
  """The memory plan of one device of a simulated group: the hardware's memory, the
  weights from the model's shapes, activations estimated at `largest_steps`."""
  model = model_shape.ModelShape.from_config(config.model)
  tensor_parallel = config.mesh.tensor_parallel
  kv_dtype = config.cache.kv_dtype
  shapes = largest_steps(config)
  # A simulated device runs the XLA paths: their tiles and unfused products.
  traits = backends.traits(config.model, choices=backends.RunChoices())
  activations = max(memory_plan.step_activation_bytes(
      model, num_tokens=tokens, num_seqs=seqs, dtype=config.model.dtype, kv_dtype=kv_dtype,
      tensor_parallel=tensor_parallel, traits=traits) for tokens, seqs, _ in shapes)
  split = f", 1/{tensor_parallel} of them" if tensor_parallel > 1 else ""
  return MemoryPlan(
      device_bytes=hardware.memory_bytes, device_source=f"{hardware.name} memory",
      utilization=_utilization(config),
      weight_bytes=cdiv(model_shape.weight_bytes(model, config.model.dtype), tensor_parallel),
      weight_source=f"from the model's shapes{split}",
      activation_bytes=activations,
      activation_source=f"estimated for the largest steps: {_steps_label(shapes)}",
      page_bytes=model_shape.kv_bytes_per_token(model, kv_dtype, tensor_parallel)
      * config.cache.page_size,
      page_size=config.cache.page_size)


def device_memory_limit() -> tuple[int | None, str]:
  """Bytes the first device's allocator may hold in all, and what they are: an
  accelerator's limit, or on CPU (arrays in host memory) the host's available memory."""
  device, stats = _device_stats()
  if "bytes_limit" in stats:
    return stats["bytes_limit"], f"{device.platform} memory limit"
  return premises.available_memory_bytes(), "host memory available"


_MEASURED: dict[str, tuple[int, str, int, str]] = {}  # one measurement per setup and process


def real_memory_plan(model: Any, config: ml_collections.ConfigDict,
                     model_config: ml_collections.ConfigDict,
                     params: Any = None) -> MemoryPlan:
  """The memory plan of a real run, before its pool is allocated: the device's memory
  from JAX, the weights' own bytes (`params`, or the shapes random weights would have),
  and the temporaries XLA assigns the compiled `largest_steps` (nothing runs). Under
  `mesh.tensor_parallel` every figure is one device's: its shards of the weights, its
  KV heads' slice of a page, its program's temporaries."""
  check_runnable(config, model_config)
  device_bytes, device_source = device_memory_limit()
  if device_bytes is None:
    raise ValueError("this device reports no memory to plan from; set "
                     "cache.kv_memory_gib or --num_pages")
  model_config = ml_collections.FrozenConfigDict(model_config)
  cache = config.cache
  tensor_parallel = config.mesh.tensor_parallel
  key = repr((getattr(model, "__name__", repr(model)), model_config.to_dict(),
              cache.page_size, cache.kv_dtype, config.scheduler.max_num_seqs,
              config.scheduler.max_num_batched_tokens,
              params is None, tensor_parallel))
  if key not in _MEASURED:
    if params is None:
      params = jax.eval_shape(functools.partial(model.random_init, model_config, config.seed))
      weight_source = "the random weights' shapes"
    else:
      weight_source = "the loaded weights"
    tp = mesh(model_config, tensor_parallel)
    probe = jax.eval_shape(functools.partial(paged_cache.init, model_config, num_pages=2,
                                             page_size=cache.page_size, dtype=cache.kv_dtype))
    if tp is not None:  # shapes laid out as the real run lays out its arrays
      params = jax.tree.map(_laid_out, params,
                            sharding.param_shardings(params, model.param_axes, tp))
      probe = jax.tree.map(lambda leaf: _laid_out(leaf, tp.cache), probe)
      weight_source += f", one device's shards of {tensor_parallel}"
    weights = sum(_device_nbytes(leaf) for leaf in jax.tree.leaves(params))
    step = step_lib.Step(functools.partial(model.forward, config=model_config,
                                           tensor_parallel=tp), tensor_parallel=tp)
    shapes = largest_steps(config)
    width = cdiv(model_config.max_seq_len, cache.page_size)
    activations = max(step.temp_bytes(
        params, probe, batch_lib.example_batch(tokens, seqs, width, decode_only=decode),
        all_greedy=False) for tokens, seqs, decode in shapes)
    _MEASURED[key] = (weights, weight_source, activations,
                      f"measured (XLA's buffer assignment) for {_steps_label(shapes)}")
  weights, weight_source, activations, activation_source = _MEASURED[key]
  return MemoryPlan(
      device_bytes=device_bytes, device_source=device_source,
      utilization=_utilization(config), weight_bytes=weights, weight_source=weight_source,
      activation_bytes=activations, activation_source=activation_source,
      page_bytes=model_shape.kv_bytes_per_token(model_shape.ModelShape.from_config(model_config),
                                             cache.kv_dtype, tensor_parallel) * cache.page_size,
      page_size=cache.page_size)


def _laid_out(leaf: Any, sharding_: Any) -> jax.ShapeDtypeStruct:
  """`leaf`'s shape carrying the sharding a real run gives it."""
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding_)


def _device_nbytes(leaf: Any) -> int:
  """Bytes one device holds of `leaf` (all of it, unless it carries a sharding)."""
  sharding_ = getattr(leaf, "sharding", None)
  shape = leaf.shape if sharding_ is None else sharding_.shard_shape(leaf.shape)
  return math.prod(shape) * leaf.dtype.itemsize


def pages_for_work(config: ml_collections.ConfigDict, lengths: list[int]) -> int:
  """Pages (null page included) that hold sequences of `lengths` tokens all at once with
  the scheduler's admission watermark still free: what a pool sized to the work needs."""
  page_size = config.cache.page_size
  held = sum(-(-min(length, config.model.max_seq_len) // page_size) for length in lengths)
  return 1 + math.ceil(held / (1 - config.scheduler.watermark))


def real_pool_pages(model: Any, config: ml_collections.ConfigDict,
                    model_config: ml_collections.ConfigDict,
                    *, pages_needed: int | None = None, params: Any = None
                    ) -> tuple[int, str, MemoryPlan | None]:
  """Pages (null page included) of a real run's KV pool, why that many, and the memory
  plan when it decided.

  In order: the config's `cache.num_pages` (a count; the experiments' `--num_pages` sets
  it); the budget `cache.kv_memory_gib` (a CPU's), capped with `cache.fit_pool` at what
  the scheduler's running set can fill at the model's full context and at `HOST_SHARE`
  of the host's available memory; with no budget (0), the memory plan
  (`real_memory_plan`: `cache.memory_utilization` of the device, less the weights
  (`params`' bytes when given) and the largest step's activations). A budget or a plan
  is capped by `pages_needed` (what the whole workload could hold at once, when it is
  known up front) so no memory is spent on pages nothing can use.
  """
  cache = config.cache
  if cache.num_pages:
    return cache.num_pages, f"cache.num_pages={cache.num_pages:,}", None
  budget = cache.get("kv_memory_gib", 0.0)
  plan = None
  if budget > 0:
    page_bytes = paged_cache.pool_bytes(model_config, num_pages=1, page_size=cache.page_size,
                                        dtype=cache.kv_dtype)
    pages = paged_cache.num_pages_for_budget(model_config, memory_bytes=int(budget * 2**30),
                                             page_size=cache.page_size, dtype=cache.kv_dtype)
    reason = (f"cache.kv_memory_gib={budget:g} GiB at {page_bytes / 2**10:,.0f} KiB a page "
              f"holds {pages:,}")
    # No more than the scheduler can fill (its whole running set at the full context),
    # nor than a share of the host's available memory: a 13 MB model gets no 4 GiB pool.
    seqs, context = config.scheduler.max_num_seqs, model_config.max_seq_len
    usable = seqs * cdiv(context, cache.page_size) + 1 if cache.get("fit_pool", True) else pages
    available = premises.available_memory_bytes() if cache.get("fit_pool", True) else None
    allowed = MAX_PAGES if available is None else int(HOST_SHARE * available) // page_bytes
    if usable < pages and usable <= allowed:
      pages, reason = usable, (f"{reason}, capped at what max_num_seqs={seqs:,} sequences of "
                               f"{context:,} tokens fill: {usable:,}")
    elif allowed < pages:
      pages, reason = max(allowed, 2), (f"{reason}, capped at {HOST_SHARE:.0%} of the host "
                                        f"memory available: {max(allowed, 2):,}")
  else:
    plan = real_memory_plan(model, config, model_config, params)
    pages, reason = min(plan.num_pages, MAX_PAGES), "the memory plan"
  if pages_needed is not None and pages_needed < pages:
    return max(pages_needed, 2), (f"{reason}; the workload needs at most {pages_needed:,} "
                                  "(all its requests at once, above the watermark)"), plan
  return pages, reason, plan


def mesh(model_config: ml_collections.ConfigDict,
         tensor_parallel: int) -> sharding.TensorParallel | None:
  """The device mesh a real step runs on: `None` on one device, else the first
  `tensor_parallel` of `jax.devices()` (every process's, in a multi-process run)."""
  if tensor_parallel == 1:
    return None
  model_shape.check_tensor_parallel(model_shape.ModelShape.from_config(model_config),
                                 tensor_parallel)
  return sharding.make(tensor_parallel, model_config.num_kv_heads)


def check_runnable(config: ml_collections.ConfigDict,
                   model: ml_collections.ConfigDict | None = None) -> None:
  """Raises ValueError unless the JAX model can run `config` (its `model` section, or
  `model`, a checkpoint's) here: a Llama (RoPE, SwiGLU) whose shapes split over
  `mesh.tensor_parallel` devices, and that many devices."""
  model = config.model if model is None else model
  if model.get("positions", "rope") != "rope" or model.get("ffn_matrices", 3) != 3:
    raise ValueError(f"{model.get('name', 'the model')} is a shape for the simulator and the "
                     "capacity model only (learned positions, a plain MLP): the JAX model is "
                     "Llama's; run it with --executor=sim")
  tensor_parallel = config.get("mesh", {}).get("tensor_parallel", 1)
  model_shape.check_tensor_parallel(model_shape.ModelShape.from_config(model), tensor_parallel)
  devices = jax.devices()
  if tensor_parallel > len(devices):
    cpu = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel} "
           "makes that many" if devices[0].platform == "cpu" else "")
    raise ValueError(f"mesh.tensor_parallel={tensor_parallel} needs {tensor_parallel} "
                     f"devices and JAX sees {len(devices)}{cpu}; or simulate it with "
                     "--executor=sim")
