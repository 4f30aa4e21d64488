r"""The streaming gateway: an OpenAI-compatible server that holds the KV line.

  python -m experiments.serve                                    # the tiny text checkpoint
  python -m experiments.serve --checkpoint=/path/to/llama        # text, chat templates
  python -m experiments.serve --config=configs/tiny.py           # random weights, token ids
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
      -d '{"prompt": "The cache", "max_tokens": 16, "stream": true}'

Builds the engine as serve_bench does (the config's scheduler section, the shortcut
flags, `--config.scheduler.KNOB=VALUE`), compiles every step shape before the port
opens, then serves `kvpage.serve.app` with uvicorn; prints the address once it
listens (`--port=0` picks a free one). SIGTERM or Ctrl-C drains: new requests get 503
`draining`, live ones run for up to `--drain_timeout_s`, the rest are aborted, and the
process exits 0; a second Ctrl-C exits at once.

Given no model (neither `--checkpoint` nor `--config`, on the JAX executor), it serves
text from kvpage's tiny text checkpoint (`models.text_checkpoint`: random weights, a
real byte-level BPE tokenizer and chat template), made offline once into a cache
directory, with `configs/tiny.py`'s settings.

`--tensor_parallel=N` steps over N devices; a multi-process run (`--num_processes`,
docs/multi_device.md) serves HTTP from process 0 while every process steps.

`--replicas=N` serves a fleet instead (`pip install -e ".[fleet]"`; docs/fleet.md): N
engines, each in a Ray Serve replica process of its own with its own pool, behind this
process's door, routed by `--router`. Without `--ray_address` a local Ray cluster
starts with the command and stops with it; with it the replicas join that cluster (one
GPU, or one per `--tensor_parallel` device, per replica where the cluster has GPUs).
"""

import logging
import os
from typing import Any

from absl import flags

from configs import base as configs_check
from configs import hardware as hardware_lib
from experiments import cli, progress
from kvpage import build
from kvpage.host import routing

_CONFIG = cli.define_config("configs/tiny.py",
                            "Config for random weights; its scheduler and cache sections "
                            "apply with --checkpoint too.")
_TENSOR_PARALLEL = cli.define_tensor_parallel()
_PROCESSES = cli.define_processes()
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Hugging Face Llama checkpoint dir "
                                  "(with its tokenizer). Neither this nor --config: kvpage's "
                                  "tiny text checkpoint, made once (models.text_checkpoint).")
TEXT_MODEL_NAME = "kvpage-tiny-text"  # what the tiny text checkpoint is served as
# The gateway's flags are shortcuts for the config's `server` section (`--port=0` sets
# `--config.server.port=0`): the config is the one record of them.
_SERVER_FLAGS = {
    "host": flags.DEFINE_string("host", None, "Address to listen on (server.host)."),
    "port": flags.DEFINE_integer("port", None, "Port to listen on; 0 = any free port "
                                 "(server.port)."),
    "served_model_name": flags.DEFINE_string(
        "served_model_name", None, "Model name clients ask for (server.served_model_name; "
        "default: the checkpoint's directory name, or the config's model name)."),
    "max_queue_wait_s": flags.DEFINE_float(
        "max_queue_wait_s", None,
        "Default wait deadline, seconds to the first step (server.max_queue_wait_s)."),
    "drain_timeout_s": flags.DEFINE_float(
        "drain_timeout_s", None,
        "On SIGTERM, how long live requests may still run (server.drain_timeout_s)."),
    "status_interval_s": flags.DEFINE_float(
        "status_interval_s", None,
        "Seconds between queueing statuses on a waiting stream (server.status_interval_s)."),
    "ttft_line_s": flags.DEFINE_float(
        "ttft_line_s", None, "Refuse (429) a request whose forecast first token comes "
        "later than this many seconds, unless the scheduler section holds a forecast-TTFT "
        "line of its own; 0 = none (server.ttft_line_s; configs/tiny.py: 0.05)."),
    "max_connections": flags.DEFINE_integer(
        "max_connections", None, "Open connections at most; at the cap a new one closes "
        "the longest-idle one (server.max_connections; 0: from the file-descriptor limit)."),
    "allowed_hosts": flags.DEFINE_string(
        "allowed_hosts", None, "Comma-separated names the Host header may carry; '*': any "
        "(server.allowed_hosts; default: loopback names when bound to loopback)."),
    "allowed_origins": flags.DEFINE_string(
        "allowed_origins", None, "Comma-separated origins CORS answers; '*': all "
        "(server.allowed_origins; default: none)."),
    "open_probes": flags.DEFINE_bool(
        "open_probes", None, "/health and /metrics need no API key (server.open_probes; "
        "default: true)."),
    "kv_pressure_status": flags.DEFINE_enum(
        "kv_pressure_status", None, ["503", "429"],
        "HTTP status for cache pressure, 429 for proxies that eject upstreams answering "
        "5xx (server.kv_pressure_status)."),
}
_API_KEY = flags.DEFINE_list(
    "api_key", None, "API keys (comma-separated; also the KVPAGE_API_KEY environment "
    "variable): /v1/* then needs 'Authorization: Bearer KEY'. Never in a config: runs "
    "record their configs.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", None, "Shortcut for --config.cache.num_pages: "
                                  "KV pages incl. the null page; 0 = what "
                                  "cache.kv_memory_gib holds, else (kv_memory_gib=0) the "
                                  "memory plan (the simulator: the plan).")
_EXECUTOR = flags.DEFINE_enum("executor", "jax", ["jax", "sim"],
                              "The real model, or a simulated GPU in real time (the step "
                              "model of --hardware, every step slept through; token ids only).")
_HARDWARE = flags.DEFINE_string("hardware", None,
                                "Shortcut for --config.hardware: the simulated device.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile every step shape before the port opens.")
_WARMUP_LOGPROBS = flags.DEFINE_bool(
    "warmup_logprobs", False, "Also compile the programs that return log-probabilities "
    "(logprobs, echo): three times the warm-up, and no compile when a request first asks "
    "(an evaluation harness's traffic).")
_WARMUP_SAMPLING = flags.DEFINE_bool("warmup_sampling", True,
                                     "Also compile the sampled (temperature > 0) steps.")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", "workdir/jax_cache", "Persistent XLA compilation cache ('' = off).")
_SCHEDULER_FLAGS = cli.define_scheduler_shortcuts()
_REPLICAS = flags.DEFINE_integer(
    "replicas", 0, "Serve a fleet of this many engines on Ray Serve, each its own process "
    "(the fleet extra); 0: one engine in this process.")
_ROUTER = flags.DEFINE_enum("router", "kv_headroom", list(routing.POLICIES),
                            "The fleet's routing policy (kvpage.host.routing).")
_RAY_ADDRESS = flags.DEFINE_string(
    "ray_address", None, "A Ray cluster for the fleet's replicas ('auto', or "
    "HOST:PORT); none: a local cluster, started and stopped with the command.")
_RAY_CPUS = flags.DEFINE_integer("ray_cpus", None, "CPUs of the local Ray cluster "
                                 "(default: the machine's).")
FLEET_NAME = "kvpage"  # the Ray Serve application


def api_keys() -> tuple[str, ...]:
  """The keys of --api_key and KVPAGE_API_KEY, both comma-separated."""
  given = [*(_API_KEY.value or ()), *os.environ.get("KVPAGE_API_KEY", "").split(",")]
  keys = tuple(dict.fromkeys(key.strip() for key in given if key.strip()))
  for key in keys:
    if not key.isascii() or not key.isprintable() or " " in key:
      raise ValueError("an API key must be printable ASCII without spaces")
  return keys


def check_flags() -> None:
  if _NUM_PAGES.value is not None and (_NUM_PAGES.value < 0 or _NUM_PAGES.value == 1):
    raise ValueError(f"--num_pages must be 0 (sized from memory) or >= 2, got "
                     f"{_NUM_PAGES.value}")
  if _REPLICAS.value < 0:
    raise ValueError(f"--replicas must be >= 0, got {_REPLICAS.value}")
  if _REPLICAS.value and (_PROCESSES.num_processes.value or 1) > 1:
    raise ValueError("--replicas runs each replica in a process of its own; a "
                     "multi-process replica (--num_processes) is not supported")
  for name in ("router", "ray_address", "ray_cpus"):
    if flags.FLAGS[name].present and not _REPLICAS.value:
      raise ValueError(f"--{name} applies to a fleet: give --replicas too")
  api_keys()


def main(argv: list[str]) -> None:
  del argv  # Unused.
  check_flags()
  try:  # the serve extra, checked before minutes of compilation (`_serve` uses it)
    from kvpage.serve import app, server  # noqa: F401
  except ImportError as error:
    raise ValueError(f"the server needs the serve extra ({error.name} is missing): "
                     "pip install -e '.[serve]'") from None
  if _REPLICAS.value:
    try:  # the fleet extra, checked before anything starts
      from kvpage.serve import ray_fleet  # noqa: F401
    except ImportError as error:
      raise ValueError(f"--replicas needs the fleet extra ({error.name} is missing): "
                       "pip install -e '.[fleet]'") from None
  from models import hf

  checkpoint, model_name = _CHECKPOINT.value, None
  made = (not checkpoint and not flags.FLAGS["config"].present and _EXECUTOR.value == "jax")
  if made:  # no model named: text out of the box
    from models import text_checkpoint

    checkpoint, model_name = str(text_checkpoint.default_checkpoint()), TEXT_MODEL_NAME
    print(f"kvpage serve: no --checkpoint or --config: serving kvpage's tiny text "
          f"checkpoint (random weights, a byte-level BPE tokenizer) from {checkpoint}",
          flush=True)
  config = cli.load_config_with_mesh(_CONFIG, _TENSOR_PARALLEL)
  cli.initialize_processes(_PROCESSES, _EXECUTOR.value)
  cli.apply_scheduler_shortcuts(config, _SCHEDULER_FLAGS)
  if _HARDWARE.value is not None:
    config.hardware = _HARDWARE.value
  if _NUM_PAGES.value is not None:
    config.cache.num_pages = _NUM_PAGES.value
  if not made:  # (the tiny text checkpoint is the config's own model: its count holds)
    cli.page_count_for_checkpoint(config, checkpoint, "num_pages")
  for name, holder in _SERVER_FLAGS.items():
    if holder.value is not None:
      config.server[name] = int(holder.value) if name == "kv_pressure_status" else holder.value
  configs_check.check(config)
  if _PROCESSES.process_id.value == 0:  # the one that serves: its port, before warm-up
    server.check_address(config.server.host, config.server.port)
  line = cli.hold_serving_line(config, watermark_given=cli.flag_or_override_given(
      "watermark", "config.scheduler.watermark"))
  cli.apply_retry_policy(config)
  if _REPLICAS.value and config.scheduler.retry_reservations:
    # A refusal holds its place (and pages) on the replica that refused it, but the
    # fleet's door asks the next replica at once: the place would hold pages for a
    # request served elsewhere, until it lapsed.
    raise ValueError("retry_reservations holds a refused request's place on one engine; "
                     "a fleet's door tries the other replicas at once, so it is not "
                     "supported with --replicas")
  tokenizer, eos_ids = None, ()
  if checkpoint:
    tokenizer = hf.load_tokenizer(checkpoint)
    eos_ids = hf.eos_token_ids(checkpoint, tokenizer)
  if checkpoint and _EXECUTOR.value == "sim":
    raise ValueError("--checkpoint needs --executor=jax (the simulator runs no weights)")
  name = model_name or (checkpoint.rstrip("/").split("/")[-1] if checkpoint
                        else config.model.name)
  if _REPLICAS.value:
    print(f"kvpage serve: lines held: {line}", flush=True)
    _serve_fleet(config, checkpoint, tokenizer, eos_ids, name)
    return
  cli.enable_compilation_cache(_COMPILATION_CACHE.value)
  setup = cli.serving_engine(config, executor=_EXECUTOR.value,
                             hardware=hardware_lib.get_hardware(config.hardware),
                             checkpoint=checkpoint, paced=True)
  if tokenizer is not None and len(tokenizer) > setup.config.model.vocab_size:
    raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                     f"is {setup.config.model.vocab_size}")
  if build.follow(setup.engine):  # a process other than 0: it steps, process 0 serves
    return
  print(f"kvpage serve: lines held: {line}", flush=True)
  try:
    _serve(setup, tokenizer, eos_ids, model_name or (
        name if checkpoint else setup.config.model.name))
  finally:
    build.stop_followers(setup.engine)


def _serve(setup: build.ServingSetup, tokenizer: Any, eos_ids: tuple[int, ...],
           name: str) -> None:
  """Warms the engine up, then serves HTTP as model `name` until a signal drains it."""
  from kvpage.serve import app as app_lib

  engine, scheduler_config = setup.engine, setup.config.scheduler
  if _WARMUP.value:
    greedy = (True, False) if _WARMUP_SAMPLING.value else (True,)
    say = lambda line: print(f"kvpage serve: {line}", flush=True)
    count = engine.executor.warmup(scheduler_config.max_num_seqs,
                                   scheduler_config.max_num_batched_tokens, all_greedy=greedy,
                                   num_decode_steps=scheduler_config.num_decode_steps,
                                   progress=progress.lines(say, "compiling step programs"),
                                   logprobs=_WARMUP_LOGPROBS.value)
    priced = engine.price_steps()  # hints and ETAs priced before the first request
    compiled = f"compiled {count} step programs" if count else "nothing to compile"
    print(f"kvpage serve: {compiled}; timed {priced} step shapes for the wait forecast",
          flush=True)
  server = setup.config.server
  server_config = app_lib.ServerConfig.from_config(
      server, model_name=name, max_model_len=engine.scheduler.max_model_len,
      eos_token_ids=eos_ids, backends=setup.backends, api_keys=api_keys())
  if setup.backends:
    print(f"kvpage serve: kernels: {cli.backends_line(setup.backends)}", flush=True)
  _listen(app_lib.Gateway(engine, server_config, tokenizer), server, server_config,
          banner=f"{setup.num_pages:,} KV pages" + (
              f" ({setup.memory_plan.reason()})" if setup.memory_plan
              else f" ({setup.pool_reason})" if setup.pool_reason else ""))


def _serve_fleet(config: Any, checkpoint: str | None, tokenizer: Any,
                 eos_ids: tuple[int, ...], name: str) -> None:
  """Starts the fleet's replicas on Ray Serve, serves HTTP here until a signal drains
  it, then stops the replicas (and the local cluster, if the command started it)."""
  from experiments import replica
  from kvpage.serve import app as app_lib
  from kvpage.serve import ray_fleet

  recipe = replica.ReplicaRecipe(
      config, _EXECUTOR.value, name,
      checkpoint=os.path.abspath(checkpoint) if checkpoint else None,
      warmup=_WARMUP.value, warmup_sampling=_WARMUP_SAMPLING.value,
      warmup_logprobs=_WARMUP_LOGPROBS.value,
      compilation_cache=(os.path.abspath(_COMPILATION_CACHE.value)
                         if _COMPILATION_CACHE.value else ""))
  logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its start-up lines
  print(f"kvpage serve: starting {_REPLICAS.value} replicas on Ray Serve "
        f"({_RAY_ADDRESS.value or 'a local cluster'}); each builds and warms its engine",
        flush=True)
  try:
    fleet = ray_fleet.start_fleet(
        recipe, num_replicas=_REPLICAS.value, policy=_ROUTER.value, name=FLEET_NAME,
        ray_address=_RAY_ADDRESS.value, num_cpus=_RAY_CPUS.value,
        gpus_per_replica=0 if _EXECUTOR.value == "sim" else None,
        devices_per_replica=config.mesh.tensor_parallel or 1)
  except RuntimeError as error:  # a replica failed to start: its error's last line
    lines = [line for line in str(error).splitlines() if line.strip()]
    raise ValueError(f"the fleet did not start: {lines[-1] if lines else error}") from None
  try:
    server = config.server
    server_config = app_lib.ServerConfig.from_config(
        server, model_name=name, max_model_len=int(fleet.info["max_model_len"]),
        eos_token_ids=eos_ids, api_keys=api_keys())
    gateway = app_lib.Gateway(ray_fleet.FleetBackend(fleet, name), server_config, tokenizer)
    _listen(gateway, server, server_config, banner=ray_fleet.fleet_banner(fleet))
  finally:
    fleet.shutdown()


def _listen(gateway: Any, server: Any, server_config: Any, banner: str) -> None:
  """Serves `gateway` on the config's address until a signal drains it."""
  from kvpage.serve import server as server_lib

  keys = server_config.api_keys
  limits = server_lib.ConnectionLimits.from_config(server)
  print(f"kvpage serve: at most {limits.max_connections:,} connections; "
        f"{len(keys)} API key{'s' if len(keys) != 1 else ''}"
        f"{' on /v1/*' if server_config.open_probes else ' on every path'}; hosts "
        f"{', '.join(server_config.allowed_hosts)}; CORS origins "
        f"{', '.join(server_config.allowed_origins) or 'none'}", flush=True)
  server_lib.serve(gateway, host=server.host, port=server.port, limits=limits,
                   banner=banner)


if __name__ == "__main__":
  cli.run(main)
