r"""The main job: how a model behaves as concurrency rises.

  python -m experiments.serve_bench                       # tiny model, real JAX, CPU
  python -m experiments.serve_bench --executor=sim --config=configs/llama_13b.py \
      --hardware=a100_80gb --num_requests=400 --arrival_rate=4 \
      --prompt_len=lognormal:512:4000 --output_len=uniform:64:512
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m experiments.serve_bench \
      --tensor_parallel=4                                 # one step over 4 CPU devices

Synthesizes (or loads, `--trace`) a seeded workload, replays it through the engine —
the real model behind `JaxExecutor` (`--executor=jax`, random weights or
`--checkpoint`) or a simulated GPU behind `SimExecutor` (`--executor=sim`, steps
priced by `kvpage.sim.step_model`) —
and writes `summary.json`, `steps.jsonl`, `requests.jsonl` and `trace.jsonl` to
`--workdir`. Scheduler policy: the config's `scheduler` section, overridable with
`--config.scheduler.KNOB=VALUE` or the shortcut flags below. `--plot` draws the run's
timeline and latency CDFs into `timeline.png` (the `notebooks` extra: matplotlib).

The config is the one record of a run: the workload and the run's own settings are
its `bench` section (`configs.base`; `BenchSettings` is the typed view of it), and every
flag below that names a setting is a shortcut that writes the config (`--arrival_rate=4`
is `--config.bench.arrival_rate=4`; `--num_pages` is `--config.cache.num_pages`).
`run_bench(config)` is the flag-free core: `experiments/sweep.py`, the studies and the
notebooks call it, so one cell of a sweep is exactly this run.
"""

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any, cast

import ml_collections
from absl import flags

from configs import base as configs_check
from configs import hardware as hardware_lib
from experiments import cli, progress
from kvpage import build, metrics, model_shape, premises, sizing
from kvpage.host import routing, scheduler_config
from kvpage.host.engine import Engine
from kvpage.memory_plan import MemoryPlan
from kvpage.request import SamplingParams
from kvpage.sim import capacity, fleet, replay, workload
from models import hf, llama

_CONFIG = cli.define_config("configs/tiny.py", "Model config file.")
# A run's settings: each flag is a shortcut for the config entry of its name, in the
# `bench` section (a `BenchSettings` field) or another (`CONFIG_SHORTCUTS`).
flags.DEFINE_enum("executor", "jax", ["jax", "sim"], "Real model or simulated GPU.")
flags.DEFINE_string("hardware", None, "Shortcut for --config.hardware: the simulated device.")
_CALIBRATION = flags.DEFINE_string(
    "calibration", None, "Shortcut for --config.sim.calibration: a calibration file "
    "(experiments/calibrate.py) whose rates price simulated steps.")
_SIM_NOISE = flags.DEFINE_bool(
    "sim_noise", None, "Shortcut for --config.sim.noise: each simulated step's time times a "
    "ratio drawn from its calibration's residuals (seeded by --config.seed).")
_TENSOR_PARALLEL = cli.define_tensor_parallel()
_PROCESSES = cli.define_processes()
flags.DEFINE_integer("num_requests", 96, "Requests in the workload.")
flags.DEFINE_string("arrival_rate", "40", "Requests/s; `inf` = all at once.")
flags.DEFINE_string("arrival_process", "poisson", "poisson | gamma:CV (bursty).")
flags.DEFINE_string("prompt_len", "lognormal:64:512",
                    "N | uniform:LO:HI | lognormal:MEDIAN:MAX | mix:F:LONG:SHORT")
flags.DEFINE_string("output_len", "uniform:16:128", "Same forms as --prompt_len.")
flags.DEFINE_string("priority", "0", "N | uniform:LO:HI (lower = more important).")
flags.DEFINE_string("shared_prefix", "", "TOKENS:GROUPS: each prompt starts with one of "
                    "GROUPS common prefixes of TOKENS tokens (--prompt_len is then the unique "
                    "suffix's length); prefix caching (cache.prefix_caching) shares them.")
flags.DEFINE_string("conversation", "", "TURNS:GAP_S: each request opens a conversation of "
                    "TURNS turns GAP_S seconds apart, each turn's prompt the history so far "
                    "(the earlier prompts, a reply per turn, a new user message).")
flags.DEFINE_string("trace", None, "Replay this JSONL trace instead of synthesizing.")
flags.DEFINE_string("lengths_csv", None, "(prompt, output) lengths, replayed in order from "
                    "a CSV (columns prompt_len, output_len or num_prefill_tokens, "
                    "num_decode_tokens), instead of --prompt_len / --output_len.")
flags.DEFINE_string("checkpoint", None, "Serve a Hugging Face Llama checkpoint.")
flags.DEFINE_bool("ignore_eos", True, "Generate exactly output_len tokens.")
flags.DEFINE_integer(
    "max_tokens", 0, "0: each request asks for its output length. N > 0: each asks for "
    "max(N, its output length) but ends (as at an EOS) after its output length, as clients "
    "who ask for more than they use; the output estimate policies see the difference.")
flags.DEFINE_integer("eos_token_id", None, "Stop token when --noignore_eos.")
flags.DEFINE_integer("seed", 0, "Workload and sampling seed.")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/serve_bench", "Where results go.")
flags.DEFINE_integer("num_pages", None, "Shortcut for --config.cache.num_pages: KV pages "
                     "incl. the null page; 0 = sized from memory (budget or plan).")
flags.DEFINE_integer("page_size", None, "Shortcut for --config.cache.page_size.")
flags.DEFINE_integer("num_host_pages", None,
                     "Shortcut for --config.scheduler.num_host_pages: host swap pool pages.")
flags.DEFINE_bool(
    "warmup", True, "jax executor: compile every step shape before the clock starts, so "
    "compilation does not pollute the measured latencies.")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", "workdir/jax_cache", "Persistent XLA compilation cache ('' = off).")
flags.DEFINE_float("slo_ttft", None, "TTFT SLO (s) for goodput.")
flags.DEFINE_float("slo_tpot", None, "TPOT SLO (s) for goodput.")
flags.DEFINE_integer("replicas", 1, "Simulated replicas (--executor=sim) behind one door, "
                     "each an engine with its own pool and clock (kvpage.sim.fleet).")
flags.DEFINE_enum("router", "kv_headroom", list(routing.POLICIES),
                  "The fleet's routing policy (kvpage.host.routing).")
flags.DEFINE_integer("router_margin_pages", routing.HEADROOM_MARGIN_PAGES,
                     "prefix_affinity: how many pages less headroom than the best the "
                     "replica holding the longest prefix may have.")
flags.DEFINE_float("router_margin_s", routing.WAIT_MARGIN_S,
                   "prefix_affinity: how much longer its forecast wait may be.")
_PLOT = flags.DEFINE_bool("plot", False, "Draw the figures (serve_bench: timeline.png; sweep: "
                          "curves.png); needs the notebooks extra (matplotlib).")
_SCHEDULER_FLAGS = cli.define_scheduler_shortcuts()


# The flags that are shortcuts for config entries outside the `bench` section.
CONFIG_SHORTCUTS = {"hardware": "hardware", "num_pages": "cache.num_pages",
                    "page_size": "cache.page_size",
                    "num_host_pages": "scheduler.num_host_pages"}


@dataclasses.dataclass(frozen=True)
class BenchSettings:
  """The typed view of a config's `bench` section (`from_config`): the workload and how
  the run measures, one field per entry and per flag of the same name."""

  executor: str = "jax"
  num_requests: int = 96
  arrival_rate: str = "40"
  arrival_process: str = "poisson"
  prompt_len: str = "lognormal:64:512"
  output_len: str = "uniform:16:128"
  priority: str = "0"
  shared_prefix: str = ""
  conversation: str = ""
  trace: str | None = None
  lengths_csv: str | None = None
  checkpoint: str | None = None
  ignore_eos: bool = True
  max_tokens: int = 0
  eos_token_id: int | None = None
  seed: int = 0
  warmup: bool = True
  slo_ttft: float | None = None
  slo_tpot: float | None = None
  replicas: int = 1
  router: str = "kv_headroom"
  router_margin_pages: int = routing.HEADROOM_MARGIN_PAGES
  router_margin_s: float = routing.WAIT_MARGIN_S

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "BenchSettings":
    """The settings of `config.bench`."""
    return cls(**{field.name: config.bench[field.name]
                  for field in dataclasses.fields(cls)})

  def check(self) -> None:
    """Rejects values no run could use, before anything is built."""
    if self.executor not in ("jax", "sim"):
      raise ValueError(f"--executor must be jax or sim, got {self.executor!r}")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"--seed must be in [0, 2**32), got {self.seed}")
    if self.checkpoint and self.executor == "sim":
      raise ValueError("--checkpoint needs --executor=jax (the simulator runs no weights)")
    for name, value in (("slo_ttft", self.slo_ttft), ("slo_tpot", self.slo_tpot)):
      if value is not None and not value > 0:
        raise ValueError(f"--{name} must be > 0 seconds, got {value}")
    if not 0 <= self.max_tokens <= workload.MAX_LENGTH:
      raise ValueError(f"--max_tokens must be in [0, {workload.MAX_LENGTH:,}], got "
                       f"{self.max_tokens}")
    if not 1 <= self.replicas <= MAX_REPLICAS:
      raise ValueError(f"--replicas must be in [1, {MAX_REPLICAS:,}], got {self.replicas}")
    if self.replicas > 1 and self.executor != "sim":
      raise ValueError("--replicas > 1 runs a simulated fleet: give --executor=sim "
                       "(a fleet of real engines: python -m experiments.serve --replicas)")
    if self.router not in routing.POLICIES:
      raise ValueError(f"--router must be one of {', '.join(routing.POLICIES)}, got "
                       f"{self.router!r}")
    if self.router_margin_pages < 0 or not self.router_margin_s >= 0:
      raise ValueError("--router_margin_pages and --router_margin_s must be >= 0")


SETTINGS = tuple(field.name for field in dataclasses.fields(BenchSettings))
MAX_REPLICAS = 1024  # a simulated fleet's bound (each replica is an engine in memory)


def setting_path(key: str) -> str | None:
  """The config entry a serve_bench flag writes (`bench.KEY`, or a shortcut's), or None."""
  if key in SETTINGS:
    return f"bench.{key}"
  return CONFIG_SHORTCUTS.get(key)


def set_path(config: ml_collections.ConfigDict, path: str, value: object) -> None:
  """Sets the config entry at the dotted `path` (its sections must exist)."""
  *sections, name = path.split(".")
  node = config
  for section in sections:
    node = node[section]
  node[name] = value


def check_shortcuts(values: dict[str, object]) -> None:
  """Rejects shortcut flag values no run could use, named by their flags."""
  num_pages, page_size, host_pages = (values.get(name) for name in (
      "num_pages", "page_size", "num_host_pages"))
  if num_pages is not None and (num_pages < 0 or num_pages == 1):
    raise ValueError(f"--num_pages must be 0 (auto) or >= 2 (page 0 is the null page), "
                     f"got {num_pages}")
  if page_size is not None and page_size <= 0:
    raise ValueError(f"--page_size must be a positive number of tokens, got {page_size}")
  if host_pages is not None and host_pages < 0:
    raise ValueError(f"--num_host_pages must be >= 0, got {host_pages}")


def check_workload_source(given: set[str]) -> None:
  """Refuses synthetic-workload settings given beside the trace or the lengths CSV that
  replaces them (as flags or `--config.bench.*` overrides): the run would ignore them
  while its record named them."""
  for source, replaced in (("trace", workload.TRACE_REPLACES),
                           ("lengths_csv", workload.LENGTHS_REPLACE)):
    clash = sorted(given & set(replaced)) if source in given else []
    if clash:
      raise ValueError(f"--{source} replaces {', '.join('--' + name for name in clash)}: "
                       "give one or the other")


def config_from_flags() -> ml_collections.ConfigDict:
  """`--config` with its overrides, then every shortcut flag given on the command line
  (the settings, the scheduler's, `--calibration`) written into it."""
  config = cli.load_config_with_mesh(_CONFIG, _TENSOR_PARALLEL)
  cli.apply_scheduler_shortcuts(config, _SCHEDULER_FLAGS)
  if _CALIBRATION.value is not None:
    config.sim.calibration = _CALIBRATION.value
  if _SIM_NOISE.value is not None:
    config.sim.noise = _SIM_NOISE.value
  given = {name: flags.FLAGS[name].value for name in (*SETTINGS, *CONFIG_SHORTCUTS)
           if flags.FLAGS[name].present}
  check_shortcuts(given)
  cli.check_one_source(config, {name: (cast(str, setting_path(name)), value)
                                for name, value in given.items()})
  overridden = {path.removeprefix("bench.") for path in cli.config_overrides()
                if path.startswith("bench.")}
  check_workload_source(set(given) | overridden)
  for name, value in given.items():
    set_path(config, setting_path(name), value)
  cli.page_count_for_checkpoint(config, config.bench.checkpoint, "num_pages")
  return config


def load_trace(config: ml_collections.ConfigDict,
               settings: BenchSettings) -> list[workload.TraceRequest]:
  if settings.trace:
    return workload.load_jsonl(settings.trace)
  try:
    rate = float(settings.arrival_rate)
  except ValueError:
    raise ValueError(f"--arrival_rate={settings.arrival_rate!r} is not a number or inf") from None
  trace = workload.synthesize(
      num_requests=settings.num_requests, arrival_rate=rate, prompt_len=settings.prompt_len,
      output_len=settings.output_len, vocab_size=config.model.vocab_size, seed=settings.seed,
      arrival_process=settings.arrival_process, priority=settings.priority,
      lengths=workload.load_lengths_csv(settings.lengths_csv) if settings.lengths_csv else None,
      shared_prefix=settings.shared_prefix)
  turns, gap_s = workload.parse_conversation(settings.conversation)
  if turns == 1:
    return trace
  return workload.conversations(trace, turns=turns, gap_s=gap_s,
                                vocab_size=config.model.vocab_size, seed=settings.seed)


def prepare(config: ml_collections.ConfigDict) -> list[workload.TraceRequest]:
  """Checks `config` as its run would: everything a run could refuse is refused here,
  before an engine is built. Returns the workload, drawn (or read) here so that a bad
  spec fails now."""
  settings = BenchSettings.from_config(config)
  settings.check()
  configs_check.check(config)
  hardware_lib.get_hardware(config.hardware)
  eos = settings.eos_token_id
  if eos is not None and not 0 <= eos < config.model.vocab_size:
    raise ValueError(f"--eos_token_id {eos} is outside the vocabulary "
                     f"[0, {config.model.vocab_size})")
  trace = load_trace(config, settings)
  if not settings.checkpoint:  # the scheduler's own check, against the length it will get
    if settings.executor == "sim":
      scheduler_config.check(config.scheduler, config.model.max_seq_len)
    else:
      num_pages, *_ = sizing.real_pool_pages(llama, config, config.model,
                                             pages_needed=pages_needed(config, settings, trace))
      scheduler_config.check(config.scheduler, sizing.max_model_len(
          config.model, num_pages=num_pages, page_size=config.cache.page_size))
  return trace


def pages_needed(config: ml_collections.ConfigDict, settings: BenchSettings,
                 trace: list[workload.TraceRequest]) -> int:
  """`sizing.pages_for_work` for every request of `trace` at its longest: a budget-sized
  pool needs no more."""
  return sizing.pages_for_work(config, [
      len(item.prompt_ids) + max(item.output_len, settings.max_tokens) for item in trace])


def run_bench(config: ml_collections.ConfigDict, *, show_progress: bool = True,
              bars: progress.Bars | None = None) -> tuple[dict, dict[str, str]]:
  """One run of `config` (its `bench` section: the workload and the run): builds the
  engine, replays the workload; returns the summary and the files (`summary.json`,
  `steps.jsonl`, `requests.jsonl`, `trace.jsonl`) by name."""
  config = ml_collections.ConfigDict(config.to_dict())  # the caller's stays as it was
  trace = prepare(config)
  settings = BenchSettings.from_config(config)
  hardware = hardware_lib.get_hardware(config.hardware)
  served = config  # the config with the model that will be served
  if settings.checkpoint:  # token ids drawn from the checkpoint's vocabulary, not the config's
    served = ml_collections.ConfigDict(config.to_dict())
    served.model = hf.load_config(settings.checkpoint)
    trace = load_trace(served, settings)
  if settings.replicas > 1:
    summary, files = serve_fleet(config, hardware, trace, settings, show_progress=show_progress,
                                 bars=bars)
    files["trace.jsonl"] = workload.to_jsonl(trace)
    return summary, files
  setup = cli.serving_engine(config, executor=settings.executor, hardware=hardware,
                             checkpoint=settings.checkpoint,
                             pages_needed=pages_needed(served, settings, trace))
  if build.follow(setup.engine):  # a process other than 0 of a multi-process run
    return {}, {}
  try:
    summary, files = serve(setup, trace, settings, show_progress=show_progress, bars=bars)
  finally:
    build.stop_followers(setup.engine)
  files["trace.jsonl"] = workload.to_jsonl(trace)
  return summary, files


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = config_from_flags()
  cli.initialize_processes(_PROCESSES, config.bench.executor)
  if _PROCESSES.process_id.value > 0:  # steps for process 0, which reports
    run_bench(config, show_progress=False)
    return
  if _PLOT.value:
    from experiments import plots  # fails now, not after the run, without matplotlib
  with cli.workdir(_WORKDIR.value) as workdir:  # fail now, not after the run
    cli.enable_compilation_cache(_COMPILATION_CACHE.value)
    summary, files = run_bench(config)
    cli.write_files(workdir, files)
    if _PLOT.value:
      plots.save(plots.timeline(summary, plots.read_jsonl(workdir / "steps.jsonl"),
                                plots.read_jsonl(workdir / "requests.jsonl")),
                 workdir / "timeline.png")
  print(format_summary(summary))
  written = "summary.json, steps.jsonl, requests.jsonl, trace.jsonl"
  print(f"\nwrote {workdir}/{written}{', timeline.png' if _PLOT.value else ''}")


def kv_waste(setup: build.ServingSetup, rows: list[dict]) -> dict | None:
  """The KV memory the run's finished requests held under paging (partial last pages)
  against contiguous max-length reservation, from their own lengths; None if none
  finished."""
  lengths = [row["prompt_tokens"] + row["output_tokens"] for row in rows
             if row["finish_reason"] in ("length", "stop")]
  if not lengths:
    return None
  model = setup.config.model
  max_len = setup.engine.scheduler.max_model_len
  shape = model_shape.ModelShape.from_config(model)
  waste = capacity.fragmentation(
      [min(n, max_len) for n in lengths], max_len=max_len,
      page_size=setup.config.cache.page_size,
      kv_bytes_per_token=model_shape.kv_bytes_per_token(shape, model.dtype))
  return dataclasses.asdict(waste)


def serve(setup: build.ServingSetup, trace: list[workload.TraceRequest],
          settings: BenchSettings, *, show_progress: bool = True,
          bars: progress.Bars | None = None) -> tuple[dict, dict[str, str]]:
  """Replays `trace` through the engine; returns the summary and the files to write.
  Its progress bar joins `bars` if given (a sweep's display), else a display of its own."""
  make_sampling = sampling_for(settings)
  stop_at_own_length = own_length_stop(trace)

  executor = setup.engine.executor
  if settings.warmup:  # the simulator compiles nothing: its warm-up is a no-op
    scheduler_config = setup.config.scheduler
    executor.warmup(scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens,
                    num_decode_steps=scheduler_config.num_decode_steps)
  compiles_before = executor.num_compiles
  # The clock of record starts here, after set-up and warm-up.
  recorder = metrics.MetricsRecorder(setup.engine.scheduler, setup.engine.clock,
                                     step_shape=setup.engine.executor.step_shape,
                                     traits=executor.traits, step_parts=executor.step_parts)
  setup.engine.on_step = recorder.on_step
  scheduler = setup.engine.scheduler
  with contextlib.ExitStack() as stack:
    if bars is None:
      bars = stack.enter_context(progress.Bars(enabled=show_progress))
    bar = bars.add(f"serve_bench[{settings.executor}]", len(trace))
    stack.callback(bar.remove)

    def on_step() -> None:
      if settings.max_tokens:
        stop_at_own_length(setup.engine)
      stats = scheduler.stats()
      bar.update(stats["num_finished"] + stats["num_rejections"], f"kv {stats['kv_usage']:.0%}")

    replay.replay(setup.engine, trace, make_sampling=make_sampling, on_submit=recorder.track,
                  on_step=on_step)
  record = dict(
      executor=settings.executor, model=setup.config.model.to_dict(),
      dtype=setup.config.model.dtype, hardware=setup.hardware_record,
      num_pages=setup.num_pages, pool_reason=setup.pool_reason,
      memory_plan=setup.memory_plan and setup.memory_plan.to_dict(),
      page_size=setup.config.cache.page_size, policies=setup.config.scheduler.to_dict(),
      seed=settings.seed,
      workload=workload_record(settings, trace),
      checkpoint=settings.checkpoint, warmup=settings.warmup,
      compiles_during_run=executor.num_compiles - compiles_before, **premises.environment(),
      **({"backends": setup.backends} if setup.backends else {}))
  summary = recorder.summary(record, settings.slo_ttft, settings.slo_tpot)
  summary["kv_waste"] = kv_waste(setup, recorder.request_rows())
  return summary, recorder.files(summary)


def sampling_for(settings: BenchSettings) -> Callable[[workload.TraceRequest], SamplingParams]:
  """Each trace request's sampling: its output length (or `max_tokens`, if more), the
  run's seed, EOS unless ignored."""
  stop_ids = (() if settings.ignore_eos or settings.eos_token_id is None
              else (settings.eos_token_id,))

  def make_sampling(item: workload.TraceRequest) -> SamplingParams:
    return SamplingParams(max_tokens=max(item.output_len, settings.max_tokens),
                          seed=settings.seed, stop_token_ids=stop_ids,
                          ignore_eos=settings.ignore_eos)
  return make_sampling


def own_length_stop(trace: list[workload.TraceRequest]) -> Callable[[Engine], None]:
  """With --max_tokens, a request asks for more than it uses: this ends each running
  request of an engine after its own output length, with finish reason "stop", before
  the next step (as an EOS would). Request ids may carry a fleet's `@replica`."""
  lengths = {item.request_id: item.output_len for item in trace}

  def stop(engine: Engine) -> None:
    for request in list(engine.scheduler.running):
      own = lengths.get(request.request_id.split("@")[0], math.inf)
      if request.num_output_tokens >= own:
        engine.abort(request.request_id, "stop")
  return stop


def serve_fleet(config: ml_collections.ConfigDict, hardware: hardware_lib.HardwareSpec,
                trace: list[workload.TraceRequest], settings: BenchSettings, *,
                show_progress: bool = True, bars: progress.Bars | None = None
                ) -> tuple[dict, dict[str, str]]:
  """Replays `trace` through a simulated fleet (`kvpage.sim.fleet`): `settings.replicas`
  engines of `config`, each with its own pool and virtual clock, behind one door routed
  by `settings.router`, each priced before the first request with `settings.warmup`,
  as a server's replica is. Returns the fleet's summary and files: `requests.jsonl` (one
  row per arrival, with the replica that served it), `steps.jsonl` (every replica's
  steps, each with its replica), `summary.json`."""
  setups = {f"r{i}": cli.serving_engine(config, executor="sim", hardware=hardware)
            for i in range(settings.replicas)}
  engines = {name: setup.engine for name, setup in setups.items()}
  if settings.warmup:  # each replica's forecast priced before its first request, as a
    for engine in engines.values():  # server's replica is (the forecast lines need it)
      engine.price_steps()
  recorders = {name: metrics.MetricsRecorder(
      engine.scheduler, engine.clock, step_shape=engine.executor.step_shape,
      traits=engine.executor.traits, step_parts=engine.executor.step_parts)
      for name, engine in engines.items()}
  stop_at_own_length = own_length_stop(trace)
  finished = [0]
  with contextlib.ExitStack() as stack:
    if bars is None:
      bars = stack.enter_context(progress.Bars(enabled=show_progress))
    bar = bars.add(f"serve_bench[fleet x{settings.replicas}]", len(trace))
    stack.callback(bar.remove)
    for name, engine in engines.items():
      def on_step(output: Any, new_tokens: dict, done: list, name: str = name,
                  engine: Engine = engine) -> None:
        recorders[name].on_step(output, new_tokens, done)
        if settings.max_tokens:
          stop_at_own_length(engine)
        finished[0] += len(done)
        bar.update(finished[0])
      engine.on_step = on_step
    router = routing.Router(settings.router, seed=settings.seed,
                            headroom_margin_pages=settings.router_margin_pages,
                            wait_margin_s=settings.router_margin_s)
    arrivals = fleet.replay_fleet(engines, router, trace, make_sampling=sampling_for(settings))
  setup = next(iter(setups.values()))
  record = dict(
      executor="sim", model=setup.config.model.to_dict(), dtype=setup.config.model.dtype,
      hardware=setup.hardware_record, num_pages=setup.num_pages, pool_reason=setup.pool_reason,
      memory_plan=setup.memory_plan and setup.memory_plan.to_dict(),
      page_size=setup.config.cache.page_size, policies=setup.config.scheduler.to_dict(),
      seed=settings.seed, workload=workload_record(settings, trace),
      fleet=dict(replicas=settings.replicas, router=settings.router,
                 router_margin_pages=settings.router_margin_pages,
                 router_margin_s=settings.router_margin_s,
                 refresh_s=fleet.REFRESH_S),
      checkpoint=None, warmup=settings.warmup, compiles_during_run=0, **premises.environment())
  summary, rows, steps = fleet.summarize(arrivals, recorders, record, settings.slo_ttft,
                                         settings.slo_tpot)
  return summary, {"requests.jsonl": "".join(json.dumps(row) + "\n" for row in rows),
                   "steps.jsonl": "".join(json.dumps(row) + "\n" for row in steps),
                   "summary.json": json.dumps(summary, indent=2)}


def _ms(value: float | None) -> str:
  return "n/a" if value is None or math.isnan(value) else f"{1e3 * value:,.1f} ms"


def _batch_line(batch: dict) -> str:
  """The time-weighted sequences per batch (`metrics.running_batch`), n/a if unmeasured."""
  if batch.get("mean") is None:
    return "n/a"
  return (f"mean {batch['mean']:,.1f} sequences (p50 {batch['p50']:,.0f}, "
          f"p99 {batch['p99']:,.0f}), weighted by time")


def _prefix_line(cache: dict) -> str:
  if not cache.get("enabled"):
    return " (prefix caching off)"
  return (f"; prefix cache hit {cache['hit_tokens']:,} of {cache['query_tokens']:,} "
          f"({cache['hit_rate']:.1%}), {cache['evicted_pages']:,} pages evicted")


def workload_record(settings: BenchSettings, trace: list[workload.TraceRequest]) -> dict:
  """The workload as it ran: a trace's file (its arrivals, lengths and priorities are
  the trace's own), or the synthetic spec, its lengths from a CSV where one was given;
  and what was observed of it."""
  spec: dict[str, object]
  if settings.trace:
    spec = dict(trace=settings.trace, arrival_rate="trace", arrival_process="trace",
                prompt_len="trace", output_len="trace")
  else:
    spec = dict(arrival_rate=settings.arrival_rate, arrival_process=settings.arrival_process,
                priority=settings.priority)
    if settings.lengths_csv:
      spec.update(lengths_csv=settings.lengths_csv, prompt_len="lengths_csv",
                  output_len="lengths_csv")
    else:
      spec.update(prompt_len=settings.prompt_len, output_len=settings.output_len,
                  shared_prefix=settings.shared_prefix, conversation=settings.conversation)
  return dict(spec, ignore_eos=settings.ignore_eos, max_tokens=settings.max_tokens,
              observed=workload.summarize(trace))


def _counts(counts: dict, prefix: str = "") -> str:
  """`{"429": 3, "503": 0}` as `HTTP 429: 3` (zeros left out), or `none`."""
  shown = [f"{prefix}{key}: {value:,}" for key, value in counts.items() if value]
  return ", ".join(shown) or "none"


def _slo_line(slo: dict) -> str:
  """The goodput SLO in words: `TTFT <= 200 ms, TPOT <= 50 ms`, or `no SLO`."""
  parts = [f"{name} <= {_ms(slo[key])}" for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"))
           if slo.get(key) is not None]
  return ", ".join(parts) if parts else "no SLO: every finished request counts"


def format_summary(summary: dict) -> str:
  """The run's summary as the command prints it (a fleet's: `_fleet_lines`)."""
  p = summary["premises"]
  w = p["workload"]
  fleet_run = p.get("fleet")
  pages = (f"{p['num_pages']:,} pages x {p['page_size']} tokens per replica" if fleet_run
           else f"{summary['pages_total']:,} pages x {p['page_size']} tokens")
  lines = [
      f"kvpage serve_bench: {p['executor']} executor, model {p['model']['name']} "
      f"({p['dtype']}), hardware {p['hardware']['name']}",
      f"  workload  {w['observed']['num_requests']} requests, "
      + (f"replayed from {w['trace']} " if w.get("trace") else
         f"rate {w['arrival_rate']}/s ({w['arrival_process']}), ")
      + f"prompt {w['prompt_len']} (observed p50 "
      f"{w['observed']['prompt_len']['p50']:.0f}, max {w['observed']['prompt_len']['max']}), "
      f"output {w['output_len']}"
      + (f", shared prefix {w['shared_prefix']}" if w.get("shared_prefix") else "")
      + (f", conversations {w['conversation']} (turns:gap s)" if w.get("conversation") else ""),
      f"  policy    prefill={p['policies']['prefill_policy']} chunk={p['policies']['chunk_size']} "
      f"budget={p['policies']['max_num_batched_tokens']} "
      f"preemption={p['policies']['preemption_mode']} "
      f"admission={p['policies'].get('admission', 'watermark')} "
      f"watermark={p['policies']['watermark']} max_waiting={p['policies']['max_waiting']} "
      f"decode_steps={p['policies'].get('num_decode_steps', 1)}",
      *([f"  kernels   {cli.backends_line(p['backends'])}"] if p.get("backends") else []),
      *([f"  fleet     {fleet_run['replicas']} replicas routed by {fleet_run['router']}"
         + (f" (margins {fleet_run['router_margin_pages']} pages, "
            f"{fleet_run['router_margin_s']:g} s)" if fleet_run["router"] == "prefix_affinity"
            else "")] if fleet_run else []),
      f"  cache     {pages}" + (f" ({p['pool_reason']})" if p.get("pool_reason") else ""),
      *[f"  {'memory' if i == 0 else '':<9} {line}" for i, line in enumerate(
          MemoryPlan.from_dict(p["memory_plan"]).lines() if p.get("memory_plan") else [])],
      *([f"  steps     tensor parallel {p['hardware']['tensor_parallel']}, priced by "
         f"{p['hardware']['step_rates_source']}"] if "step_rates_source" in p["hardware"] else []),
      *([f"  steps     tensor parallel {p['hardware']['tensor_parallel']}: weights and KV "
         "heads split over that many devices"]
        if "step_rates_source" not in p["hardware"]
        and p["hardware"].get("tensor_parallel", 1) > 1 else []),
      "",
  ]
  return "\n".join(lines + (_fleet_lines(summary) if fleet_run else _engine_lines(summary)))


def _latency_lines(summary: dict) -> list[str]:
  return [
      f"  queue wait  p50 / p99    {_ms(summary['queue_wait_s']['p50'])} / "
      f"{_ms(summary['queue_wait_s']['p99'])}",
      f"  TTFT        p50 / p99    {_ms(summary['ttft_s']['p50'])} / "
      f"{_ms(summary['ttft_s']['p99'])}",
      f"  TPOT        p50 / p99    {_ms(summary['tpot_s']['p50'])} / "
      f"{_ms(summary['tpot_s']['p99'])}",
      f"  throughput               {summary['prompt_tokens_per_s']:,.0f} prompt tok/s, "
      f"{summary['output_tokens_per_s']:,.0f} generated tok/s over {summary['duration_s']:.2f} s",
  ]


def _goodput_line(summary: dict) -> str:
  return (f"  goodput                  {summary['goodput_requests_per_s']:.2f} req/s "
          f"({summary['goodput_fraction']:.0%} of requests; {_slo_line(summary['slo'])})")


def _fleet_lines(summary: dict) -> list[str]:
  """A simulated fleet's figures (`kvpage.sim.fleet.summarize`)."""
  imbalance = summary["pool_imbalance_over_time"]
  hit = summary["prefix_hit_rate"]
  return [
      f"  admitted / finished      {summary['num_admitted']} / {summary['num_finished']}",
      f"  refused by every replica {_counts(summary['rejections'], 'HTTP ') }",
      f"  door retries             {summary['door_retries']:,} replicas asked after a "
      f"refusal; {summary['refused_while_room']:,} requests refused by one replica while "
      "another had room",
      f"  preemptions              {summary['num_preemptions']}",
      f"  KV usage                 peak {summary['max_kv_usage']:.1%}; fullest over mean pool "
      + ("n/a" if imbalance is None else f"{imbalance:.2f} on average over time")
      + (f", peaks {summary['pool_peak_imbalance']:.2f}"
         if summary["pool_peak_imbalance"] else ""),
      *_latency_lines(summary), _goodput_line(summary),
      "  prefix cache             " + ("off" if hit is None else f"hit rate {hit:.1%}"),
  ]


def _engine_lines(summary: dict) -> list[str]:
  """One engine's figures (`kvpage.metrics.MetricsRecorder.summary`)."""
  lines = [
      f"  admitted / finished      {summary['num_admitted']} / {summary['num_finished']}",
      f"  rejections               {_counts(summary['rejections'], 'HTTP ')}",
      f"  preemptions              {summary['num_preemptions']}"
      + (f" ({_counts(summary['preemptions'])})" if summary["num_preemptions"] else ""),
      f"  max KV usage             {summary['max_kv_usage']:.1%} "
      f"(free pages at end {summary['pages_free_at_end']:,})",
      *_latency_lines(summary),
      f"  running batch            {_batch_line(summary.get('running_batch') or {})}",
      _goodput_line(summary),
      f"  prefill computed         {summary['prefill_tokens_computed']:,} tokens"
      + _prefix_line(summary.get("prefix_cache", {})),
  ]
  waste = summary.get("kv_waste")
  if waste:
    lines.append(
        f"  KV waste                 paged {waste['paged_waste']:.1%} (partial last pages) vs "
        f"{waste['contiguous_waste']:.1%} reserving {waste['max_len']:,} tokens each: "
        f"{waste['paged_reserved_bytes'] / 2**20:,.1f} vs "
        f"{waste['contiguous_reserved_bytes'] / 2**20:,.1f} MiB for the finished requests")
  return lines


if __name__ == "__main__":
  cli.run(main)
