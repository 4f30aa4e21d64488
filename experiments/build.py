"""Wiring: a model (or a simulated GPU) and a scheduler config into an `Engine`.

kvpage is model-agnostic and models import kvpage, so the two meet here, in the
experiments layer: `llama_engine` closes the model's forward over its config, puts
it behind a `JaxExecutor` with a paged cache, and pairs it with a `Scheduler`;
`sim_engine` pairs the very same `Scheduler` with a `SimExecutor` on virtual time,
its steps priced by a `StepModel` at the hardware's rates (`step_rates`: a calibration
file's, or the entry's template).
"""

import dataclasses
import functools
import math
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

import configs
from kvpage import batch as batch_lib
from kvpage.device import attention, multihost, sharding
from kvpage.device import cache as paged_cache
from kvpage.device import step as step_lib
from kvpage.device.executor import JaxExecutor
from kvpage.host.engine import Engine
from kvpage.host.replicas import Replicas
from kvpage.host.scheduler import Scheduler
from kvpage.sim import calibration, capacity, memory_plan, premises
from kvpage.sim.clock import PacedClock, VirtualClock, WallClock
from kvpage.sim.executor import SimExecutor
from kvpage.sim.hardware import HardwareSpec
from kvpage.sim.memory_plan import MemoryPlan
from kvpage.sim.step_model import StepModel, StepRates
from kvpage.units import cdiv
from models import hf, llama

CALIBRATIONS = pathlib.Path(configs.__file__).parent / "calibrations"

MAX_PAGES = 2**24  # pages in one pool: 268M tokens at 16 per page


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
  model = capacity.ModelShape.from_config(model_config)
  kv = whole // model.num_kv_heads * capacity.kv_heads_per_device(model, tensor_parallel)
  weights = 0 if weights_loaded else cdiv(capacity.weight_bytes(model, model_config.dtype),
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


def llama_engine(model_config: ml_collections.ConfigDict, params: Any,
                 scheduler_config: ml_collections.ConfigDict, *, num_pages: int,
                 page_size: int, num_host_pages: int = 0, kv_dtype: str | None = None,
                 clock: Callable[[], float] | None = None,
                 on_step: Callable[..., None] | None = None,
                 tensor_parallel: int = 1, prefix_caching: bool = False,
                 memory_hint: str = "lower --num_pages or --page_size",
                 step: step_lib.Step | None = None) -> Engine:
  """An engine serving a Llama model through a paged cache of `num_pages` pages.

  `kv_dtype` (default: the model's) is the cache's storage precision;
  `prefix_caching` shares the pages of computed prefixes (`cache.prefix_caching`). With
  `tensor_parallel` > 1 the step runs on that many devices (`mesh`): weights, KV heads
  and the pool split over them, one scheduler on the host as before. `step`: another
  engine's jitted step to share (`llama_replicas`).
  """
  model_config = ml_collections.FrozenConfigDict(model_config)
  tp = mesh(model_config, tensor_parallel)
  check_memory(model_config, num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype,
               num_host_pages=num_host_pages, weights_loaded=True,
               tensor_parallel=tensor_parallel, hint=memory_hint)
  max_len = max_model_len(model_config, num_pages=num_pages, page_size=page_size)
  cache = paged_cache.init(model_config, num_pages=num_pages, page_size=page_size,
                           dtype=kv_dtype, sharding=None if tp is None else tp.cache)
  forward = functools.partial(llama.forward, config=model_config, tensor_parallel=tp)
  buckets = batch_lib.Buckets.for_server(max_model_len=max_len,
                                         page_size=page_size,
                                         max_num_seqs=scheduler_config.max_num_seqs)
  # Mosaic GPU's interpreter (the `mosaic` kernel on CPU) moves scalars to the device
  # inside its own callbacks: the guard would refuse them, so it only logs there.
  interpreted_mosaic = (model_config.get("attention_impl") == "mosaic"
                        and jax.default_backend() == "cpu")
  executor = JaxExecutor(forward, params, cache, num_host_pages=num_host_pages, buckets=buckets,
                         tensor_parallel=tp, param_axes=llama.param_axes,
                         guard="log" if interpreted_mosaic else "disallow",
                         decode_reads_longest=attention.decode_reads_longest(
                             model_config.get("attention_impl", "xla"),
                             kv_dtype=paged_cache.jnp_dtype(kv_dtype or model_config.dtype),
                             num_heads=model_config.num_heads,
                             num_kv_heads=model_config.num_kv_heads,
                             head_dim=model_config.head_dim),
                         step=step)
  if jax.process_count() > 1 and multihost.is_leader():
    executor = multihost.Leader(executor)  # every process steps; process 0 schedules
  scheduler = Scheduler(scheduler_config, num_pages=num_pages, page_size=page_size,
                        max_model_len=max_len,
                        num_host_pages=num_host_pages, clock=clock or WallClock(),
                        vocab_size=model_config.vocab_size, prefix_caching=prefix_caching)
  return Engine(scheduler, executor, on_step=on_step,
                async_scheduling=scheduler_config.async_scheduling)


def llama_replicas(model_config: ml_collections.ConfigDict, params: Any,
                   scheduler_config: ml_collections.ConfigDict, *, replicas: int,
                   num_pages: int, page_size: int, kv_dtype: str | None = None,
                   memory_hint: str = "lower --num_pages or --page_size") -> Replicas:
  """`replicas` engines over one copy of the weights on the default device, each with a
  pool of `num_pages` pages and its own scheduler (`kvpage.host.replicas`), sharing one
  jitted step: the pools have one shape, so each program compiles once for all."""
  if not isinstance(replicas, int) or replicas < 1:
    raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
  check_memory(model_config, num_pages=replicas * num_pages, page_size=page_size,
               kv_dtype=kv_dtype, weights_loaded=True, hint=memory_hint)
  params = jax.device_put(params)  # once: every engine's executor then holds these arrays
  engines: list[Engine] = []
  for _ in range(replicas):
    engines.append(llama_engine(
        model_config, params, scheduler_config.copy_and_resolve_references(),
        num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype, memory_hint=memory_hint,
        step=engines[0].executor.step if engines else None))
  return Replicas(engines)


def mesh(model_config: ml_collections.ConfigDict,
         tensor_parallel: int) -> sharding.TensorParallel | None:
  """The device mesh a real step runs on: `None` on one device, else the first
  `tensor_parallel` of `jax.devices()` (every process's, in a multi-process run)."""
  if tensor_parallel == 1:
    return None
  capacity.check_tensor_parallel(capacity.ModelShape.from_config(model_config),
                                 tensor_parallel)
  return sharding.make(tensor_parallel, model_config.num_kv_heads)


def follow(engine: Engine) -> bool:
  """In a multi-process run, on a process other than 0: replays process 0's steps on
  this process's devices until it stops, then returns True (the caller has nothing
  else to do). Elsewhere: False, at once."""
  if jax.process_count() == 1 or multihost.is_leader():
    return False
  multihost.follow(engine.executor)
  return True


def stop_followers(engine: Engine) -> None:
  """Process 0 of a multi-process run: lets the other processes' `follow` return."""
  if isinstance(engine.executor, multihost.Leader):
    engine.executor.stop()


def step_rates(hardware: HardwareSpec, calibration_file: str = "") -> tuple[StepRates, str]:
  """The simulator's step rates and where they come from: `calibration_file` when given,
  else the file the hardware entry names (in `configs/calibrations/`), else its template."""
  path = calibration_file or (str(CALIBRATIONS / hardware.calibration)
                              if hardware.calibration else "")
  if not path:
    return StepRates.template(hardware), f"template rates of {hardware.name}"
  record = calibration.load(path)
  fitted = record.get("premises", {})
  if not calibration_file:  # the shipped file, named as in the repository, not this machine
    path = f"configs/calibrations/{hardware.calibration}"
  return (StepRates.from_dict(record["rates"]),
          f"calibration {path} (fit on {fitted.get('model', '?')}, tensor parallel "
          f"{fitted.get('tensor_parallel', '?')}, {fitted.get('hardware', '?')})")


def step_model(config: ml_collections.ConfigDict, rates: StepRates,
               hardware: HardwareSpec) -> StepModel:
  """Prices `config`'s model on one device of its `mesh.tensor_parallel` group."""
  return StepModel(capacity.ModelShape.from_config(config.model), rates,
                   weight_dtype=config.model.dtype, kv_dtype=config.cache.kv_dtype,
                   page_size=config.cache.page_size,
                   tensor_parallel=config.mesh.tensor_parallel,
                   host_link_bandwidth=hardware.host_link_bandwidth)


def sim_engine(model_config: ml_collections.ConfigDict, hardware: HardwareSpec,
               scheduler_config: ml_collections.ConfigDict, *, num_pages: int, page_size: int,
               kv_dtype: str | None = None, num_host_pages: int = 0,
               paced: bool = False, tensor_parallel: int = 1,
               rates: StepRates | None = None, prefix_caching: bool = False) -> Engine:
  """An engine over a simulated GPU group: the same scheduler, a `StepModel` executor,
  virtual time (`paced`: wall time, each step slept through, to serve live clients).
  `rates`: default the hardware's own (`step_rates`); rates fit on padded steps price
  each step at the shape a kvpage server pads it to."""
  clock = PacedClock() if paced else VirtualClock()
  rates = rates or step_rates(hardware)[0]
  model = StepModel(capacity.ModelShape.from_config(model_config),
                    rates, weight_dtype=model_config.dtype,
                    kv_dtype=kv_dtype, page_size=page_size, tensor_parallel=tensor_parallel,
                    host_link_bandwidth=hardware.host_link_bandwidth)
  scheduler = Scheduler(scheduler_config, num_pages=num_pages, page_size=page_size,
                        max_model_len=model_config.max_seq_len, num_host_pages=num_host_pages,
                        clock=clock, vocab_size=model_config.vocab_size,
                        prefix_caching=prefix_caching)
  buckets = batch_lib.Buckets.for_server(
      max_model_len=model_config.max_seq_len, page_size=page_size,
      max_num_seqs=scheduler_config.max_num_seqs) if rates.padded_work else None
  # The simulated device overlaps with the host as a real one does (`SimExecutor`), so
  # async scheduling delays a new request by the same step it costs on a real run.
  return Engine(scheduler, SimExecutor(model, clock, buckets),
                async_scheduling=scheduler_config.async_scheduling)


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
  model = capacity.ModelShape.from_config(config.model)
  tensor_parallel = config.mesh.tensor_parallel
  kv_dtype = config.cache.kv_dtype
  shapes = largest_steps(config)
  activations = max(memory_plan.step_activation_bytes(
      model, num_tokens=tokens, num_seqs=seqs, dtype=config.model.dtype, kv_dtype=kv_dtype,
      tensor_parallel=tensor_parallel) for tokens, seqs, _ in shapes)
  split = f", 1/{tensor_parallel} of them" if tensor_parallel > 1 else ""
  return MemoryPlan(
      device_bytes=hardware.memory_bytes, device_source=f"{hardware.name} memory",
      utilization=_utilization(config),
      weight_bytes=cdiv(capacity.weight_bytes(model, config.model.dtype), tensor_parallel),
      weight_source=f"from the model's shapes{split}",
      activation_bytes=activations,
      activation_source=f"estimated for the largest steps: {_steps_label(shapes)}",
      page_bytes=capacity.kv_bytes_per_token(model, kv_dtype, tensor_parallel)
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


def real_memory_plan(config: ml_collections.ConfigDict,
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
  key = repr((model_config.to_dict(), cache.page_size, cache.kv_dtype,
              config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
              params is None, tensor_parallel))
  if key not in _MEASURED:
    if params is None:
      params = jax.eval_shape(functools.partial(llama.random_init, model_config, config.seed))
      weight_source = "the random weights' shapes"
    else:
      weight_source = "the loaded weights"
    tp = mesh(model_config, tensor_parallel)
    probe = jax.eval_shape(functools.partial(paged_cache.init, model_config, num_pages=2,
                                             page_size=cache.page_size, dtype=cache.kv_dtype))
    if tp is not None:  # shapes laid out as the real run lays out its arrays
      params = jax.tree.map(_laid_out, params,
                            sharding.param_shardings(params, llama.param_axes, tp))
      probe = jax.tree.map(lambda leaf: _laid_out(leaf, tp.cache), probe)
      weight_source += f", one device's shards of {tensor_parallel}"
    weights = sum(_device_nbytes(leaf) for leaf in jax.tree.leaves(params))
    step = step_lib.Step(functools.partial(llama.forward, config=model_config,
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
      page_bytes=capacity.kv_bytes_per_token(capacity.ModelShape.from_config(model_config),
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
  capacity.check_tensor_parallel(capacity.ModelShape.from_config(model), tensor_parallel)
  devices = jax.devices()
  if tensor_parallel > len(devices):
    cpu = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel} "
           "makes that many" if devices[0].platform == "cpu" else "")
    raise ValueError(f"mesh.tensor_parallel={tensor_parallel} needs {tensor_parallel} "
                     f"devices and JAX sees {len(devices)}{cpu}; or simulate it with "
                     "--executor=sim")


@dataclasses.dataclass
class ServingSetup:
  engine: Engine
  config: ml_collections.ConfigDict
  num_pages: int
  hardware_record: dict[str, Any]
  pool_reason: str = ""  # why the pool has `num_pages` pages, for the run header
  memory_plan: MemoryPlan | None = None  # when the plan sized the pool


def pages_for_work(config: ml_collections.ConfigDict, lengths: list[int]) -> int:
  """Pages (null page included) that hold sequences of `lengths` tokens all at once with
  the scheduler's admission watermark still free: what a pool sized to the work needs."""
  page_size = config.cache.page_size
  held = sum(-(-min(length, config.model.max_seq_len) // page_size) for length in lengths)
  return 1 + math.ceil(held / (1 - config.scheduler.watermark))


def real_pool_pages(config: ml_collections.ConfigDict, model_config: ml_collections.ConfigDict,
                    *, num_pages: int = 0, checkpoint: bool = False,
                    pages_needed: int | None = None, params: Any = None
                    ) -> tuple[int, str, MemoryPlan | None]:
  """Pages (null page included) of a real run's KV pool, why that many, and the memory
  plan when it decided.

  In order: `num_pages` (a flag); the config's `cache.num_pages`, unless a checkpoint
  replaced the config's model (a page count is model-specific, a byte budget is not);
  the budget `cache.kv_memory_gib`; with no budget (0), the memory plan
  (`real_memory_plan`: `cache.memory_utilization` of the device, less the weights
  (`params`' bytes when given) and the largest step's activations). A budget or a plan
  is capped by `pages_needed` (what the whole workload could hold at once, when it is
  known up front) so no memory is spent on pages nothing can use.
  """
  if num_pages:
    return num_pages, "--num_pages", None
  cache = config.cache
  if cache.num_pages and not checkpoint:
    return cache.num_pages, f"cache.num_pages={cache.num_pages:,} in the config", None
  budget = cache.get("kv_memory_gib", 0.0)
  plan = None
  if budget > 0:
    page_bytes = paged_cache.pool_bytes(model_config, num_pages=1, page_size=cache.page_size,
                                        dtype=cache.kv_dtype)
    pages = paged_cache.num_pages_for_budget(model_config, memory_bytes=int(budget * 2**30),
                                             page_size=cache.page_size, dtype=cache.kv_dtype)
    reason = (f"cache.kv_memory_gib={budget:g} GiB at {page_bytes / 2**10:,.0f} KiB a page "
              f"holds {pages:,}")
  else:
    plan = real_memory_plan(config, model_config, params)
    pages, reason = min(plan.num_pages, MAX_PAGES), "the memory plan"
  if checkpoint and cache.num_pages:
    reason += f" (cache.num_pages={cache.num_pages:,} sizes the config's own model)"
  if pages_needed is not None and pages_needed < pages:
    return max(pages_needed, 2), (f"{reason}; the workload needs at most {pages_needed:,} "
                                  "(all its requests at once, above the watermark)"), plan
  return pages, reason, plan


def serving_engine(config: ml_collections.ConfigDict, *, executor: str, hardware: HardwareSpec,
                   checkpoint: str | None = None, num_pages: int = 0,
                   paced: bool = False, pages_needed: int | None = None) -> ServingSetup:
  """The engine `serve_bench` runs: real (`jax`, random weights or a checkpoint) or `sim`
  (`paced`: in wall time, for a live server). A real run's pool: `real_pool_pages`; a
  simulated one's: `--num_pages`, else the memory plan (`sim_memory_plan`)."""
  page_size, host_pages = config.cache.page_size, config.scheduler.num_host_pages
  if executor == "sim":
    for name, value in (("num_pages", num_pages), ("num_host_pages", host_pages)):
      # Simulated pages cost no memory but the host's page pool keeps a few words per
      # page; a real pool is bounded by `check_memory` instead, which names the bytes.
      if not 0 <= value <= MAX_PAGES:
        raise ValueError(f"--{name} must be in [0, {MAX_PAGES:,}], got {value:,}")
    tensor_parallel = config.mesh.tensor_parallel
    plan, reason = None, "--num_pages"
    if not num_pages:
      plan = sim_memory_plan(config, hardware)
      num_pages, reason = min(plan.num_pages, MAX_PAGES), "the memory plan"
    rates, rates_source = step_rates(hardware, config.sim.calibration)
    engine = sim_engine(config.model, hardware, config.scheduler, num_pages=num_pages,
                        page_size=page_size, kv_dtype=config.cache.kv_dtype,
                        num_host_pages=host_pages, paced=paced,
                        tensor_parallel=tensor_parallel, rates=rates,
                        prefix_caching=config.cache.get("prefix_caching", False))
    record = dict(dataclasses.asdict(hardware), tensor_parallel=tensor_parallel,
                  step_rates=rates.to_dict(), step_rates_source=rates_source)
    return ServingSetup(engine, config, num_pages, record, reason, plan)
  params = None
  if checkpoint:
    model_config, params = hf.load(checkpoint)
    check_runnable(config, model_config)
    # How attention and the products run is the config's choice (its hardware's), not
    # the checkpoint's.
    llama.keep_run_choices(model_config, config.model)
    config.model = model_config
    config.cache.kv_dtype = model_config.dtype  # the checkpoint's precision, not the config's
  num_pages, pool_reason, plan = real_pool_pages(config, config.model, num_pages=num_pages,
                                                 checkpoint=bool(checkpoint),
                                                 pages_needed=pages_needed, params=params)
  if jax.process_count() > 1:  # one pool on every process: process 0's size
    num_pages = multihost.agree(num_pages)
  tensor_parallel = config.mesh.tensor_parallel
  if not checkpoint:
    check_runnable(config)
    check_memory(config.model, num_pages=num_pages, page_size=page_size,
                 kv_dtype=config.cache.kv_dtype, num_host_pages=host_pages,
                 tensor_parallel=tensor_parallel)
    params = llama.random_init(config.model, config.seed)
  engine = llama_engine(config.model, params, config.scheduler, num_pages=num_pages,
                        page_size=page_size, num_host_pages=host_pages,
                        kv_dtype=config.cache.kv_dtype, tensor_parallel=tensor_parallel,
                        prefix_caching=config.cache.get("prefix_caching", False))
  device = jax.devices()[0]
  return ServingSetup(engine, config, num_pages,
                      dict(name=f"{device.platform} (real run)", device=str(device),
                           tensor_parallel=tensor_parallel), pool_reason, plan)
