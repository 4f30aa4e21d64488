"""Shared builder for config files: a model from the table plus the serving knobs.

A config has three sections:
  * `model`: dimensions from `configs.model_table` plus the weight `dtype`;
  * `cache`: paged KV-cache layout (`page_size`, `kv_dtype`, `num_pages` or a budget,
    `prefix_caching`);
  * `hardware`: a key into `configs.hardware.HARDWARE`;
  * `mesh`: how many devices one step runs on (`tensor_parallel`; the simulator and the
    capacity model split weights and KV heads over them);
  * `sim`: the simulator's step rates (`calibration`: a calibration file; "" = the
    hardware entry's own, calibrated or template; `noise`: draw each step's time from
    the calibration's residuals, seeded by `seed`).
Later sections (scheduler, engine) are added by the modules that own them.
"""

import ml_collections

from configs import model_table, scheduler
from kvpage import memory_plan, model_shape, units
from kvpage.device import backends
from kvpage.host import routing

DTYPES = tuple(units.DTYPES)


def model_config(name: str, dtype: str) -> ml_collections.ConfigDict:
  """The `model` section for table entry `name` stored in `dtype`."""
  if name not in model_table.MODEL_TABLE:
    raise ValueError(
        f"unknown model {name!r}; choose one of: {', '.join(sorted(model_table.MODEL_TABLE))}"
    )
  config = ml_collections.ConfigDict(dict(model_table.MODEL_TABLE[name]))
  config.name = name
  config.dtype = dtype
  config.rope_scaling = ml_collections.ConfigDict(
      dict(enabled=False, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
           original_max_seq_len=8192)
  )
  # The run choices: which backends compute the model's ops (kvpage.device.backends).
  backends.RunChoices().write(config)
  return config


def build(name: str, default_dtype: str, variant: str | None, hardware: str,
          tensor_parallel: int = 1) -> ml_collections.ConfigDict:
  """A full config; `variant` (the part after `:` in `--config=file.py:variant`) is a dtype."""
  dtype = variant or default_dtype
  if dtype not in DTYPES:
    raise ValueError(f"unknown config variant {variant!r}; choose a dtype: {', '.join(DTYPES)}")
  config = ml_collections.ConfigDict()
  config.model = model_config(name, dtype)
  if hardware == "cpu":  # the C++ kernels: attention reading pages in place, and the
    config.model.attention_impl = "cpu"  # products of few rows on all cores
    config.model.linear_impl = "cpu"
    # Products of many rows (prompt chunks) in three bf16 passes on AMX where the CPU
    # has it (~1e-5 relative of fp32, twice XLA's fp32 speed); elsewhere fp32 as before.
    config.model.matmul_precision = "high"
  # A run's KV pool: `num_pages` when set (real and simulated runs alike), else for a
  # real run as many pages as `kv_memory_gib` holds (4 GiB is vLLM's CPU default KV
  # space), else (`kv_memory_gib=0`, as on a GPU) the memory plan: `memory_utilization`
  # of the device, less the weights and the largest step's activations
  # (`kvpage.sizing.real_pool_pages`); a simulated run's plan is on the hardware
  # entry's memory (`sim_memory_plan`).
  # `prefix_caching`: full pages of computed tokens are named and shared by later
  # requests with the same prefix (kvpage.host.prefix_cache), on by default as in vLLM.
  # `fit_pool`: a byte budget's pool is capped at what the scheduler can fill (its
  # running set at the model's full context) and at half the host's available memory.
  config.cache = ml_collections.ConfigDict(dict(page_size=16, kv_dtype=dtype, num_pages=0,
                                                kv_memory_gib=4.0, fit_pool=True,
                                                memory_utilization=memory_plan.DEFAULT_UTILIZATION,
                                                prefix_caching=True))
  config.hardware = hardware
  config.mesh = ml_collections.ConfigDict(dict(tensor_parallel=tensor_parallel))
  config.sim = ml_collections.ConfigDict(dict(calibration="", noise=False))
  config.seed = 0
  config.scheduler = scheduler.get_scheduler_config()
  # A serve_bench run (`experiments.serve_bench.BenchSettings`, whose flags of the same
  # names set these): the executor, the workload (lengths as `N`, `uniform:LO:HI`,
  # `lognormal:MEDIAN:MAX` or `mix:FRACTION:LONG:SHORT`; a rate in requests/s or `inf`;
  # or a `trace` / `lengths_csv` file), its seed, the warm-up, and the goodput SLOs; and
  # `replicas` > 1, a simulated fleet behind one door routed by `router`
  # (`kvpage.host.routing`; the margins are prefix_affinity's).
  placeholder = ml_collections.config_dict.placeholder
  config.bench = ml_collections.ConfigDict(dict(
      executor="jax", num_requests=96, arrival_rate="40", arrival_process="poisson",
      prompt_len="lognormal:64:512", output_len="uniform:16:128", priority="0",
      shared_prefix="", conversation="", trace=placeholder(str), lengths_csv=placeholder(str),
      checkpoint=placeholder(str), ignore_eos=True, max_tokens=0,
      eos_token_id=placeholder(int), seed=0, warmup=True, slo_ttft=placeholder(float),
      slo_tpot=placeholder(float), replicas=1, router="kv_headroom",
      router_margin_pages=routing.HEADROOM_MARGIN_PAGES,
      router_margin_s=routing.WAIT_MARGIN_S))
  # How the streaming gateway (`python -m experiments.serve`) listens and answers
  # (`kvpage.serve.app.ServerConfig.from_config`); its flags of the same names set these.
  # `served_model_name` "" = the checkpoint's directory name, else the model's name;
  # `max_queue_wait_s` None = no default wait deadline.
  # `ttft_line_s`: the forecast-TTFT line the server holds when the scheduler section
  # holds none of its own (`max_forecast_ttft_s` and `max_ttft_slowdown` both 0): a
  # request whose forecast first token comes later than this is refused (429
  # wait_forecast, with a retry hint). It is in seconds of the deployment's TTFT SLO,
  # so a model config sets it from its own measurements (benchmarks/overload_http.py);
  # None or 0 = none (offline runs, serve_bench, never hold it).
  # `watermark`: the KV line the server holds (`scheduler.watermark` when serving, unless
  # the command line sets that): 0.4, from the line study (experiments/line_study.py,
  # docs/serving.md). With the forecast-TTFT line at a quarter of the TTFT SLO, 0.4 serves
  # a median 96% of the best tuned line's goodput over the 12 overloaded cells of the
  # 13B-on-A100 setup (the scheduler's template, 0.15: 53%), as much as 0.15 at 1x, and
  # the same as any watermark up to 0.5 on Yi-34B TP2, where memory never binds.
  #
  # Exposed to a network (docs/serving.md, "Hostile clients"): `max_connections` open
  # connections at most (0: from the process's file-descriptor limit); at the cap, a new
  # connection closes the longest-idle one (no request in progress), else it is refused.
  # A request's headers must arrive within `header_timeout_s` (also the first request's,
  # from the connection's opening), at most `max_headers` of `max_header_bytes` in all;
  # its body within `body_timeout_s`; an idle keep-alive connection closes after
  # `keep_alive_s`. `allowed_hosts`: comma-separated names the Host header may carry
  # ("*": any; "": the loopback names when bound to a loopback address, else any).
  # `allowed_origins`: comma-separated origins CORS answers ("": none, "*": all).
  # `open_probes`: /health and /metrics need no API key (the keys: --api_key or
  # KVPAGE_API_KEY, never a config, which runs record). `retry_jitter`: each retry hint
  # is stretched by a seeded factor in [1, 1 + this), so a refused burst does not come
  # back at one instant (`scheduler.retry_jitter` when serving, unless that is set).
  # `retry_audit`: how many refused requests the server watches at once to learn how long
  # each really had to wait (`scheduler.retry_audit` when serving, unless that is set;
  # /metrics: kvpage:retry_hint_ratio). `retry_reservations`: true turns on
  # `scheduler.retry_reservations` when serving: a refused request keeps its place in
  # line, and a retry that sends back the refusal's `x-request-id` finds it.
  config.server = server_defaults()
  return config


def server_defaults() -> ml_collections.ConfigDict:
  """The `server` section every config starts from (see `build`'s comments)."""
  placeholder = ml_collections.config_dict.placeholder
  return ml_collections.ConfigDict(dict(
      host="127.0.0.1", port=8000, served_model_name="",
      max_queue_wait_s=placeholder(float), drain_timeout_s=30.0,
      status_interval_s=1.0, kv_pressure_status=503, ttft_line_s=placeholder(float),
      watermark=0.4,
      max_connections=0, header_timeout_s=10.0, body_timeout_s=30.0, keep_alive_s=5.0,
      max_headers=100, max_header_bytes=65536, allowed_hosts="", allowed_origins="",
      open_probes=True, retry_jitter=0.25, retry_audit=64, retry_reservations=False))


# Dimensions index int32 arrays on the device, so none may exceed int32.
_MAX_DIM = 2**31 - 1
_MODEL_INTS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "d_model", "ffn_dim",
               "vocab_size", "max_seq_len")


def _positive_int(where: str, value: object, low: int = 1) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _MAX_DIM:
    raise ValueError(f"{where} must be an integer in [{low}, {_MAX_DIM:,}], got {value!r}")


def _positive_number(where: str, value: object, zero_is_off: bool = False) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      (value >= 0 if zero_is_off else value > 0) and value < float("inf")):
    bound = ">= 0 (0: off)" if zero_is_off else "> 0"
    raise ValueError(f"{where} must be a finite number {bound}, got {value!r}")


def check_model(model, where: str = "model") -> None:
  """Raises `ValueError` naming the first field of a `model` section that cannot work.

  An override such as `--config.model.max_seq_len=0` parses (it is an int) and
  would otherwise surface much later as a shape error or an empty run.
  """
  for name in _MODEL_INTS:
    _positive_int(f"{where}.{name}", model.get(name), 2 if name == "vocab_size" else 1)
  if model.num_heads % model.num_kv_heads:
    raise ValueError(f"{where}.num_kv_heads={model.num_kv_heads} must divide "
                     f"num_heads={model.num_heads}")
  if model.get("positions", "rope") == "rope":
    _positive_number(f"{where}.rope_theta", model.get("rope_theta"))
  _positive_number(f"{where}.norm_eps", model.get("norm_eps"))
  if model.get("dtype") not in DTYPES:
    raise ValueError(f"{where}.dtype {model.get('dtype')!r}: choose one of {', '.join(DTYPES)}")
  scaling = model.get("rope_scaling")
  if scaling is not None and scaling.get("enabled"):
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
      _positive_number(f"{where}.rope_scaling.{name}", scaling.get(name))
    if not scaling.low_freq_factor < scaling.high_freq_factor:
      raise ValueError(f"{where}.rope_scaling needs low_freq_factor < high_freq_factor")
    _positive_int(f"{where}.rope_scaling.original_max_seq_len",
                  scaling.get("original_max_seq_len"))
  try:
    backends.check(model)
  except ValueError as error:
    raise ValueError(f"{where}.{error}") from None


def check(config) -> None:
  """`check_model` plus the `cache` and `mesh` sections; the scheduler section has its
  own check."""
  check_model(config.model)
  mesh = config.get("mesh")
  if mesh is not None:
    _positive_int("mesh.tensor_parallel", mesh.get("tensor_parallel"))
    model_shape.check_tensor_parallel(model_shape.ModelShape.from_config(config.model),
                                   mesh.tensor_parallel)
  cache = config.cache
  _positive_int("cache.page_size", cache.get("page_size"))
  _positive_int("cache.num_pages", cache.get("num_pages"), 0)
  if cache.num_pages == 1:
    raise ValueError("cache.num_pages must be 0 (sized from memory) or >= 2 (page 0 is the "
                     "null page), got 1")
  budget = cache.get("kv_memory_gib")
  if budget != 0:
    _positive_number("cache.kv_memory_gib", budget)
  utilization = cache.get("memory_utilization", memory_plan.DEFAULT_UTILIZATION)
  _positive_number("cache.memory_utilization", utilization)
  if utilization > 1:
    raise ValueError(f"cache.memory_utilization must be in (0, 1], got {utilization!r}")
  if not isinstance(cache.get("fit_pool", True), bool):
    raise ValueError(f"cache.fit_pool must be true or false, got {cache.get('fit_pool')!r}")
  if not isinstance(cache.get("prefix_caching", False), bool):
    raise ValueError(f"cache.prefix_caching must be true or false, got "
                     f"{cache.get('prefix_caching')!r}")
  if config.get("server") is not None:
    check_server(config.server)
  if cache.get("kv_dtype") not in DTYPES:
    raise ValueError(f"cache.kv_dtype {cache.get('kv_dtype')!r}: choose one of "
                     f"{', '.join(DTYPES)}")


def check_server(server) -> None:
  """Raises `ValueError` naming the first field of a `server` section that cannot work."""
  port = server.get("port")
  if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
    raise ValueError(f"server.port must be in [0, 65535] (0: any free port), got {port!r}")
  for name in ("drain_timeout_s", "status_interval_s", "max_queue_wait_s",
               "header_timeout_s", "body_timeout_s", "keep_alive_s"):
    value = server.get(name)
    if value is not None or name != "max_queue_wait_s":  # a drain of 0 s aborts at once
      _positive_number(f"server.{name}", value, zero_is_off=name == "drain_timeout_s")
  _positive_int("server.max_connections", server.get("max_connections"), 0)
  _positive_int("server.max_headers", server.get("max_headers"))
  _positive_int("server.max_header_bytes", server.get("max_header_bytes"), 1024)
  for name in ("allowed_hosts", "allowed_origins"):
    if not isinstance(server.get(name), str):
      raise ValueError(f"server.{name} must be a comma-separated string, got "
                       f"{server.get(name)!r}")
  _positive_number("server.retry_jitter", server.get("retry_jitter"), zero_is_off=True)
  _positive_int("server.retry_audit", server.get("retry_audit"), 0)
  for name in ("open_probes", "retry_reservations"):
    if not isinstance(server.get(name), bool):
      raise ValueError(f"server.{name} must be true or false, got {server.get(name)!r}")
  if server.get("ttft_line_s") is not None:  # None or 0: no serving line
    _positive_number("server.ttft_line_s", server.ttft_line_s, zero_is_off=True)
  mark = server.get("watermark", 0.0)
  if not (isinstance(mark, (int, float)) and not isinstance(mark, bool) and 0 <= mark < 1):
    raise ValueError(f"server.watermark must be a number in [0, 1), got {mark!r}")
  if server.get("kv_pressure_status") not in (429, 503):
    raise ValueError(f"server.kv_pressure_status must be 503 or 429, got "
                     f"{server.get('kv_pressure_status')!r}")
