r"""The main job: how a model behaves as concurrency rises.

  python -m experiments.serve_bench                       # tiny model, real JAX, CPU
  python -m experiments.serve_bench --executor=sim --config=configs/llama_13b.py \
      --hardware=a100_80gb --num_requests=400 --arrival_rate=4 \
      --prompt_len=lognormal:512:4000 --output_len=uniform:64:512

Synthesizes (or loads, `--trace`) a seeded workload, replays it through the engine —
the real model behind `JaxExecutor` (`--executor=jax`, random weights or
`--checkpoint`) or a roofline-priced GPU behind `SimExecutor` (`--executor=sim`) —
and writes `summary.json`, `steps.jsonl`, `requests.jsonl` and `trace.jsonl` to
`--workdir`. Scheduler policy: the config's `scheduler` section, overridable with
`--config.scheduler.KNOB=VALUE` or the shortcut flags below.
"""

import math

import ml_collections
from absl import flags

from configs import base as configs_check
from configs import hardware as hardware_lib
from experiments import build, cli, progress
from kvpage.host.request import SamplingParams
from kvpage.sim import metrics, premises, replay, workload

_CONFIG = cli.define_config("configs/tiny.py", "Model config file.")
_EXECUTOR = flags.DEFINE_enum("executor", "jax", ["jax", "sim"], "Real model or simulated GPU.")
_HARDWARE = flags.DEFINE_string("hardware", None, "Simulated device (default: config's).")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 96, "Requests in the workload.")
_ARRIVAL_RATE = flags.DEFINE_string("arrival_rate", "40", "Requests/s; `inf` = all at once.")
_ARRIVAL = flags.DEFINE_string("arrival_process", "poisson", "poisson | gamma:CV (bursty).")
_PROMPT_LEN = flags.DEFINE_string("prompt_len", "lognormal:64:512",
                                  "N | uniform:LO:HI | lognormal:MEDIAN:MAX | mix:F:LONG:SHORT")
_OUTPUT_LEN = flags.DEFINE_string("output_len", "uniform:16:128", "Same forms as --prompt_len.")
_PRIORITY = flags.DEFINE_string("priority", "0", "N | uniform:LO:HI (lower = more important).")
_TRACE = flags.DEFINE_string("trace", None, "Replay this JSONL trace instead of synthesizing.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Serve a Hugging Face Llama checkpoint.")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", True, "Generate exactly output_len tokens.")
_EOS_ID = flags.DEFINE_integer("eos_token_id", None, "Stop token when --noignore_eos.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload and sampling seed.")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/serve_bench", "Where results go.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 0, "KV pages incl. the null page; 0 = auto.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", None, "Tokens per page (default: config's).")
_NUM_HOST_PAGES = flags.DEFINE_integer("num_host_pages", None, "Host swap pool pages.")
_WARMUP = flags.DEFINE_bool(
    "warmup", True, "jax executor: compile every step shape before the clock starts, so "
    "compilation does not pollute the measured latencies.")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", "workdir/jax_cache", "Persistent XLA compilation cache ('' = off).")
_SLO_TTFT = flags.DEFINE_float("slo_ttft", None, "TTFT SLO (s) for goodput.")
_SLO_TPOT = flags.DEFINE_float("slo_tpot", None, "TPOT SLO (s) for goodput.")
_SCHEDULER_FLAGS = cli.define_scheduler_shortcuts()


def apply_overrides(config: ml_collections.ConfigDict) -> None:
  """Shortcut scheduler flags into `config.scheduler`, typed like the defaults."""
  cli.apply_scheduler_shortcuts(config, _SCHEDULER_FLAGS)
  if _PAGE_SIZE.value is not None:
    if _PAGE_SIZE.value <= 0:
      raise ValueError(f"--page_size must be a positive number of tokens, got {_PAGE_SIZE.value}")
    config.cache.page_size = _PAGE_SIZE.value
  if _NUM_HOST_PAGES.value is not None:
    if _NUM_HOST_PAGES.value < 0:
      raise ValueError(f"--num_host_pages must be >= 0, got {_NUM_HOST_PAGES.value}")
    config.scheduler.num_host_pages = _NUM_HOST_PAGES.value


def check_flags() -> None:
  """Rejects flag values no run could use, before anything is built."""
  if _NUM_PAGES.value < 0 or _NUM_PAGES.value == 1:
    raise ValueError(f"--num_pages must be 0 (auto) or >= 2 (page 0 is the null page), "
                     f"got {_NUM_PAGES.value}")
  if not 0 <= _SEED.value < 2**32:
    raise ValueError(f"--seed must be in [0, 2**32), got {_SEED.value}")
  if _CHECKPOINT.value and _EXECUTOR.value == "sim":
    raise ValueError("--checkpoint needs --executor=jax (the simulator runs no weights)")
  for name, value in (("slo_ttft", _SLO_TTFT.value), ("slo_tpot", _SLO_TPOT.value)):
    if value is not None and not value > 0:
      raise ValueError(f"--{name} must be > 0 seconds, got {value}")


def load_trace(config: ml_collections.ConfigDict) -> list[workload.TraceRequest]:
  if _TRACE.value:
    return workload.load_jsonl(_TRACE.value)
  try:
    rate = float(_ARRIVAL_RATE.value)
  except ValueError:
    raise ValueError(f"--arrival_rate={_ARRIVAL_RATE.value!r} is not a number or inf") from None
  return workload.synthesize(
      num_requests=_NUM_REQUESTS.value, arrival_rate=rate, prompt_len=_PROMPT_LEN.value,
      output_len=_OUTPUT_LEN.value, vocab_size=config.model.vocab_size, seed=_SEED.value,
      arrival_process=_ARRIVAL.value, priority=_PRIORITY.value)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  check_flags()
  config = cli.load_config(_CONFIG)
  apply_overrides(config)
  configs_check.check(config)
  hardware = hardware_lib.get_hardware(_HARDWARE.value or config.hardware)
  eos = _EOS_ID.value
  if eos is not None and not 0 <= eos < config.model.vocab_size:
    raise ValueError(f"--eos_token_id {eos} is outside the vocabulary "
                     f"[0, {config.model.vocab_size})")
  with cli.workdir(_WORKDIR.value) as workdir:  # fail now, not after the run
    cli.enable_compilation_cache(_COMPILATION_CACHE.value)
    setup = build.serving_engine(config, executor=_EXECUTOR.value, hardware=hardware,
                                 checkpoint=_CHECKPOINT.value, num_pages=_NUM_PAGES.value)
    trace = load_trace(setup.config)
    summary, files = serve(setup, trace)
    files["trace.jsonl"] = workload.to_jsonl(trace)
    cli.write_files(workdir, files)
  print(format_summary(summary))
  print(f"\nwrote {workdir}/summary.json, steps.jsonl, requests.jsonl, trace.jsonl")


def serve(setup: build.ServingSetup,
          trace: list[workload.TraceRequest]) -> tuple[dict, dict[str, str]]:
  """Replays `trace` through the engine; returns the summary and the files to write."""
  stop_ids = () if _IGNORE_EOS.value or _EOS_ID.value is None else (_EOS_ID.value,)

  def make_sampling(item: workload.TraceRequest) -> SamplingParams:
    return SamplingParams(max_tokens=item.output_len, seed=_SEED.value,
                          stop_token_ids=stop_ids, ignore_eos=_IGNORE_EOS.value)

  executor = setup.engine.executor
  if _WARMUP.value:  # the simulator compiles nothing: its warm-up is a no-op
    scheduler_config = setup.config.scheduler
    executor.warmup(scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens,
                    num_decode_steps=scheduler_config.num_decode_steps)
  compiles_before = executor.num_compiles
  # The clock of record starts here, after set-up and warm-up.
  recorder = metrics.MetricsRecorder(setup.engine.scheduler, setup.engine.clock)
  setup.engine.on_step = recorder.on_step
  bar = progress.Progress(len(trace), f"serve_bench[{_EXECUTOR.value}]")
  scheduler = setup.engine.scheduler

  def show_progress() -> None:
    stats = scheduler.stats()
    bar.update(stats["num_finished"] + stats["num_rejections"], f"kv {stats['kv_usage']:.0%}")

  replay.replay(setup.engine, trace, make_sampling=make_sampling, on_submit=recorder.track,
                on_step=show_progress)
  bar.close()
  record = dict(
      executor=_EXECUTOR.value, model=setup.config.model.to_dict(),
      dtype=setup.config.model.dtype, hardware=setup.hardware_record,
      num_pages=setup.num_pages, page_size=setup.config.cache.page_size,
      policies=setup.config.scheduler.to_dict(), seed=_SEED.value,
      workload=dict(arrival_rate=_ARRIVAL_RATE.value, arrival_process=_ARRIVAL.value,
                    prompt_len=_PROMPT_LEN.value, output_len=_OUTPUT_LEN.value,
                    priority=_PRIORITY.value, trace=_TRACE.value, ignore_eos=_IGNORE_EOS.value,
                    observed=workload.summarize(trace)),
      checkpoint=_CHECKPOINT.value, warmup=_WARMUP.value,
      compiles_during_run=executor.num_compiles - compiles_before, **premises.environment())
  summary = recorder.summary(record, _SLO_TTFT.value, _SLO_TPOT.value)
  return summary, recorder.files(summary)


def _ms(value: float | None) -> str:
  return "n/a" if value is None or math.isnan(value) else f"{1e3 * value:,.1f} ms"


def format_summary(summary: dict) -> str:
  p = summary["premises"]
  w = p["workload"]
  lines = [
      f"kvpage serve_bench: {p['executor']} executor, model {p['model']['name']} "
      f"({p['dtype']}), hardware {p['hardware']['name']}",
      f"  workload  {w['observed']['num_requests']} requests, rate {w['arrival_rate']}/s "
      f"({w['arrival_process']}), prompt {w['prompt_len']} (observed p50 "
      f"{w['observed']['prompt_len']['p50']:.0f}, max {w['observed']['prompt_len']['max']}), "
      f"output {w['output_len']}",
      f"  policy    prefill={p['policies']['prefill_policy']} chunk={p['policies']['chunk_size']} "
      f"budget={p['policies']['max_num_batched_tokens']} "
      f"preemption={p['policies']['preemption_mode']} "
      f"watermark={p['policies']['watermark']} max_waiting={p['policies']['max_waiting']} "
      f"decode_steps={p['policies'].get('num_decode_steps', 1)}",
      f"  cache     {summary['pages_total']:,} pages x {p['page_size']} tokens",
      "",
      f"  admitted / finished      {summary['num_admitted']} / {summary['num_finished']}",
      f"  rejections               {summary['rejections']}",
      f"  preemptions              {summary['num_preemptions']} {summary['preemptions']}",
      f"  max KV usage             {summary['max_kv_usage']:.1%} "
      f"(free pages at end {summary['pages_free_at_end']:,})",
      f"  queue wait  p50 / p99    {_ms(summary['queue_wait_s']['p50'])} / "
      f"{_ms(summary['queue_wait_s']['p99'])}",
      f"  TTFT        p50 / p99    {_ms(summary['ttft_s']['p50'])} / "
      f"{_ms(summary['ttft_s']['p99'])}",
      f"  TPOT        p50 / p99    {_ms(summary['tpot_s']['p50'])} / "
      f"{_ms(summary['tpot_s']['p99'])}",
      f"  throughput               {summary['prompt_tokens_per_s']:,.0f} prompt tok/s, "
      f"{summary['output_tokens_per_s']:,.0f} generated tok/s over {summary['duration_s']:.2f} s",
      f"  goodput                  {summary['goodput_requests_per_s']:.2f} req/s "
      f"({summary['goodput_fraction']:.0%} of requests; SLO {summary['slo']})",
  ]
  return "\n".join(lines)


if __name__ == "__main__":
  cli.run(main)
