"""Building an engine is a library call: a model (or a simulated GPU), a config, an `Engine`.

kvpage is model-agnostic and models import kvpage, so a model comes in as an argument:
any object with the model functions (`Model`: a module such as `models.llama` is one).

  * `jax_engine` closes the model's forward over its config, puts it behind a
    `JaxExecutor` with a paged cache and the backend's cost traits, and pairs it with a
    `Scheduler`; `jax_replicas` makes several over one copy of the weights;
  * `sim_engine` pairs the very same `Scheduler` with a `SimExecutor` on virtual time,
    its steps priced by a `StepModel` at the hardware's rates (`step_rates`: a
    calibration file's, or the entry's template);
  * `serving_engine` is the whole recipe a run follows from a config: the pool sized
    (`kvpage.sizing`), the engine built, and what runs recorded (`ServingSetup`).

`experiments/` keeps the flags, the printing and the files around these calls.
"""

import dataclasses
import functools
import pathlib
from collections.abc import Callable
from typing import Any, Protocol

import jax
import ml_collections

from kvpage import batch as batch_lib
from kvpage import model_shape
from kvpage.clock import PacedClock, VirtualClock, WallClock
from kvpage.device import backends, multihost
from kvpage.device import cache as paged_cache
from kvpage.device import step as step_lib
from kvpage.device.executor import JaxExecutor
from kvpage.host.engine import Engine
from kvpage.host.replicas import Replicas
from kvpage.host.scheduler import Scheduler
from kvpage.memory_plan import MemoryPlan
from kvpage.sim import calibration
from kvpage.sim.executor import SimExecutor
from kvpage.sim.hardware import HardwareSpec
from kvpage.sim.step_model import StepModel, StepNoise, StepRates
from kvpage.sizing import (
    MAX_PAGES,
    check_memory,
    check_runnable,
    max_model_len,
    mesh,
    real_pool_pages,
    sim_memory_plan,
)


class Model(Protocol):
  """The model functions an engine needs (`models.llama` is one)."""

  def forward(self, params: Any, cache: paged_cache.PagedKVCache, batch: Any, *,
              config: ml_collections.ConfigDict, tensor_parallel: Any = None) -> Any:
    """`(logits of the sampled rows, updated cache)` of one step."""

  def random_init(self, config: ml_collections.ConfigDict, seed: int = 0) -> Any:
    """Random parameters for a model section."""

  def param_axes(self, path: tuple[str, ...]) -> tuple[str | None, ...]:
    """Logical names of a parameter's dimensions, for tensor parallelism."""


def jax_engine(model: Model, model_config: ml_collections.ConfigDict, params: Any,
               scheduler_config: ml_collections.ConfigDict, *, num_pages: int,
               page_size: int, num_host_pages: int = 0, kv_dtype: str | None = None,
               clock: Callable[[], float] | None = None,
               on_step: Callable[..., None] | None = None,
               tensor_parallel: int = 1, prefix_caching: bool = False,
               memory_hint: str = "lower --num_pages or --page_size",
               step: step_lib.Step | None = None) -> Engine:
  """An engine serving `model` (its section `model_config`, weights `params`) through a
  paged cache of `num_pages` pages.

  `kv_dtype` (default: the model's) is the cache's storage precision;
  `prefix_caching` shares the pages of computed prefixes (`cache.prefix_caching`). With
  `tensor_parallel` > 1 the step runs on that many devices (`mesh`): weights, KV heads
  and the pool split over them, one scheduler on the host as before. `step`: another
  engine's jitted step to share (`jax_replicas`).
  """
  model_config = ml_collections.FrozenConfigDict(model_config)
  tp = mesh(model_config, tensor_parallel)
  check_memory(model_config, num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype,
               num_host_pages=num_host_pages, weights_loaded=True,
               tensor_parallel=tensor_parallel, hint=memory_hint)
  max_len = max_model_len(model_config, num_pages=num_pages, page_size=page_size)
  cache = paged_cache.init(model_config, num_pages=num_pages, page_size=page_size,
                           dtype=kv_dtype, sharding=None if tp is None else tp.cache)
  forward = functools.partial(model.forward, config=model_config, tensor_parallel=tp)
  buckets = batch_lib.Buckets.for_server(max_model_len=max_len,
                                         page_size=page_size,
                                         max_num_seqs=scheduler_config.max_num_seqs)
  executor = JaxExecutor(forward, params, cache, num_host_pages=num_host_pages, buckets=buckets,
                         tensor_parallel=tp, param_axes=model.param_axes,
                         guard=backends.transfer_guard(model_config),
                         traits=backends.traits(
                             model_config, kv_dtype=paged_cache.jnp_dtype(
                                 kv_dtype or model_config.dtype),
                             tensor_parallel=tensor_parallel),
                         step=step)
  if jax.process_count() > 1 and multihost.is_leader():
    executor = multihost.Leader(executor)  # every process steps; process 0 schedules
  scheduler = Scheduler(scheduler_config, num_pages=num_pages, page_size=page_size,
                        max_model_len=max_len,
                        num_host_pages=num_host_pages, clock=clock or WallClock(),
                        vocab_size=model_config.vocab_size, prefix_caching=prefix_caching)
  return Engine(scheduler, executor, on_step=on_step,
                async_scheduling=scheduler_config.async_scheduling)


def jax_replicas(model: Model, model_config: ml_collections.ConfigDict, params: Any,
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
    engines.append(jax_engine(
        model, model_config, params, scheduler_config.copy_and_resolve_references(),
        num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype, memory_hint=memory_hint,
        step=engines[0].executor.step if engines else None))
  return Replicas(engines)


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


def step_rates(hardware: HardwareSpec, calibration_file: str = "",
               calibrations: pathlib.Path | None = None) -> tuple[StepRates, str]:
  """The simulator's step rates and where they come from: `calibration_file` when given,
  else the file the hardware entry names (in the folder `calibrations`, which ships
  them: `configs/calibrations/`), else its template; a file measured on another device
  is carried to this one by the datasheets (`StepRates.carried_to`). Raises
  `ValueError` where the entry names a file and no folder is given: its template would
  silently price differently."""
  if not calibration_file and hardware.calibration and calibrations is None:
    raise ValueError(f"hardware {hardware.name} is priced by its calibration "
                     f"{hardware.calibration}: pass the folder that holds it (calibrations=)")
  path = calibration_file or (str(calibrations / hardware.calibration)
                              if calibrations and hardware.calibration else "")
  if not path:
    return StepRates.template(hardware), f"template rates of {hardware.name}"
  record = calibration.load(path)
  fitted = record.get("premises", {})
  if not calibration_file and calibrations:  # shipped: named as in the repository
    path = f"{calibrations.parent.name}/{calibrations.name}/{hardware.calibration}"
  rates = StepRates.from_dict(record["rates"])
  carried = rates.carried_to(hardware)
  return (carried, f"calibration {path} (fit on {fitted.get('model', '?')}, tensor parallel "
          f"{fitted.get('tensor_parallel', '?')}, {fitted.get('hardware', '?')}"
          + (f"; carried to {hardware.name} by the datasheets)" if carried is not rates
             else ")"))


def step_model(config: ml_collections.ConfigDict, rates: StepRates,
               hardware: HardwareSpec) -> StepModel:
  """Prices `config`'s model on one device of its `mesh.tensor_parallel` group."""
  return StepModel(model_shape.ModelShape.from_config(config.model), rates,
                   weight_dtype=config.model.dtype, kv_dtype=config.cache.kv_dtype,
                   page_size=config.cache.page_size,
                   tensor_parallel=config.mesh.tensor_parallel,
                   host_link_bandwidth=hardware.host_link_bandwidth)


def sim_engine(model_config: ml_collections.ConfigDict, hardware: HardwareSpec,
               scheduler_config: ml_collections.ConfigDict, *, num_pages: int, page_size: int,
               kv_dtype: str | None = None, num_host_pages: int = 0,
               paced: bool = False, tensor_parallel: int = 1,
               rates: StepRates | None = None, prefix_caching: bool = False,
               calibrations: pathlib.Path | None = None,
               noise_seed: int | None = None) -> Engine:
  """An engine over a simulated GPU group: the same scheduler, a `StepModel` executor,
  virtual time (`paced`: wall time, each step slept through, to serve live clients).
  `rates`: default the hardware's own (`step_rates`, from `calibrations`); rates fit on
  padded steps price each step at the shape a kvpage server pads it to. `noise_seed`:
  each step's seconds times a ratio drawn from the rates' residuals (`StepNoise`); None:
  none."""
  clock = PacedClock() if paced else VirtualClock()
  rates = rates or step_rates(hardware, calibrations=calibrations)[0]
  model = StepModel(model_shape.ModelShape.from_config(model_config),
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
  noise = None if noise_seed is None else StepNoise(rates.noise_quantiles, noise_seed)
  return Engine(scheduler, SimExecutor(model, clock, buckets, noise),
                async_scheduling=scheduler_config.async_scheduling)


@dataclasses.dataclass
class ServingSetup:
  engine: Engine
  config: ml_collections.ConfigDict
  num_pages: int
  hardware_record: dict[str, Any]
  pool_reason: str = ""  # why the pool has `num_pages` pages, for the run header
  memory_plan: MemoryPlan | None = None  # when the plan sized the pool
  # What computes each op (`kvpage.device.backends.describe`); None on the simulator.
  backends: dict[str, Any] | None = None


def serving_engine(config: ml_collections.ConfigDict, *, executor: str, hardware: HardwareSpec,
                   model: Model | None = None, params: Any = None, paced: bool = False,
                   pages_needed: int | None = None,
                   calibrations: pathlib.Path | None = None) -> ServingSetup:
  """The engine a run serves from, all of it read from `config`: real (`jax`: `model`,
  with `params` (a checkpoint's, `config.model` being its section) or else random
  weights) or `sim` (`paced`: in wall time, for a live server; `calibrations`: the
  folder of the hardware entries' calibration files). A real run's pool:
  `kvpage.sizing.real_pool_pages`; a simulated one's: `cache.num_pages` when set, else
  the memory plan of the hardware (`sim_memory_plan`). `pages_needed` caps a pool sized
  from memory to what the workload can hold at once."""
  page_size, host_pages = config.cache.page_size, config.scheduler.num_host_pages
  num_pages = config.cache.num_pages
  if executor == "sim":
    for name, value in (("cache.num_pages", num_pages),
                        ("scheduler.num_host_pages", host_pages)):
      # Simulated pages cost no memory but the host's page pool keeps a few words per
      # page; a real pool is bounded by `check_memory` instead, which names the bytes.
      if not 0 <= value <= MAX_PAGES:
        raise ValueError(f"{name} must be in [0, {MAX_PAGES:,}], got {value:,}")
    tensor_parallel = config.mesh.tensor_parallel
    plan, reason = None, f"cache.num_pages={num_pages:,}"
    if not num_pages:
      plan = sim_memory_plan(config, hardware)
      num_pages, reason = min(plan.num_pages, MAX_PAGES), "the memory plan"
    rates, rates_source = step_rates(hardware, config.sim.calibration, calibrations)
    engine = sim_engine(config.model, hardware, config.scheduler, num_pages=num_pages,
                        page_size=page_size, kv_dtype=config.cache.kv_dtype,
                        num_host_pages=host_pages, paced=paced,
                        tensor_parallel=tensor_parallel, rates=rates,
                        prefix_caching=config.cache.get("prefix_caching", False),
                        noise_seed=config.seed if config.sim.get("noise") else None)
    record = dict(dataclasses.asdict(hardware), tensor_parallel=tensor_parallel,
                  step_rates=rates.to_dict(), step_rates_source=rates_source,
                  step_noise=bool(config.sim.get("noise")))
    return ServingSetup(engine, config, num_pages, record, reason, plan)
  if model is None:
    raise ValueError("a real run (executor='jax') needs the model's functions (model=)")
  num_pages, pool_reason, plan = real_pool_pages(model, config, config.model,
                                                 pages_needed=pages_needed, params=params)
  if jax.process_count() > 1:  # one pool on every process: process 0's size
    num_pages = multihost.agree(num_pages)
  tensor_parallel = config.mesh.tensor_parallel
  if params is None:
    check_runnable(config)
    check_memory(config.model, num_pages=num_pages, page_size=page_size,
                 kv_dtype=config.cache.kv_dtype, num_host_pages=host_pages,
                 tensor_parallel=tensor_parallel)
    params = model.random_init(config.model, config.seed)
  engine = jax_engine(model, config.model, params, config.scheduler, num_pages=num_pages,
                      page_size=page_size, num_host_pages=host_pages,
                      kv_dtype=config.cache.kv_dtype, tensor_parallel=tensor_parallel,
                      prefix_caching=config.cache.get("prefix_caching", False))
  device = jax.devices()[0]
  return ServingSetup(engine, config, num_pages,
                      dict(name=f"{device.platform} (real run)", device=str(device),
                           tensor_parallel=tensor_parallel), pool_reason, plan,
                      backends.describe(config.model, kv_dtype=config.cache.kv_dtype,
                                        tensor_parallel=tensor_parallel))
