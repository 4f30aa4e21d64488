r"""Host overhead of one scheduling step: 256 running and 1,000 waiting requests.

  python benchmarks/scheduler_overhead.py --out=scheduler_overhead.json

The scheduler runs between device steps, so its time is pure loss for the GPU: a
decode step of a 13B model on an A100 takes ~20-30 ms, and the host must decide the
next batch in a small fraction of that. This benchmark fills the running set
(`max_num_seqs` requests decoding, fake tokens, no model) with a long waiting queue
behind it, then times `schedule()` and `update()` for `--num_steps` steady-state
steps. Requests never finish during the measurement (`--max_tokens` exceeds the
steps), so every step sees the same load; pages cross a boundary every
`page_size` steps, so allocation is exercised too.

Prints a table with its premises (machine, Python, knobs) and writes JSON with
`median_ms` and `p99_ms` for a whole host step (schedule + update), plus each part.
"""

import json
import math
import statistics
import time

import numpy as np
from absl import flags
from ml_collections import config_flags

from experiments import cli
from kvpage import premises as environment
from kvpage.host.scheduler import Scheduler
from kvpage.request import Request, SamplingParams

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/tiny.py", "Config file; its `scheduler` section holds the knobs.")
_OUT = flags.DEFINE_string("out", "scheduler_overhead.json", "Where to write the JSON record.")
_NUM_RUNNING = flags.DEFINE_integer("num_running", 256, "Requests decoding at once.")
_NUM_WAITING = flags.DEFINE_integer("num_waiting", 1000, "Requests queued behind them.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per request.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 1024, "Output tokens per request.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 500, "Timed steps.")
_NUM_WARMUP = flags.DEFINE_integer("num_warmup", 50, "Untimed steady-state steps first.")
_TARGET_MS = flags.DEFINE_float("target_ms", 1.0, "Median budget the table checks against.")


def build(config) -> Scheduler:
  """A scheduler whose pool admits every request and whose running set is full."""
  sched = config.scheduler
  sched.max_num_seqs = _NUM_RUNNING.value
  sched.max_waiting = max(sched.max_waiting, _NUM_WAITING.value, _NUM_RUNNING.value)
  page_size = config.cache.page_size
  total = _NUM_RUNNING.value + _NUM_WAITING.value
  pages_per_request = math.ceil((_PROMPT_LEN.value + _MAX_TOKENS.value) / page_size)
  num_pages = 2 + math.ceil(total * pages_per_request / (1 - sched.watermark))
  scheduler = Scheduler(sched, num_pages=num_pages, page_size=page_size,
                        max_model_len=config.model.max_seq_len)
  rng = np.random.default_rng(config.seed)
  for i in range(total):
    if i == _NUM_RUNNING.value:  # fill: prefill the running set, then queue the rest
      while any(r.num_output_tokens == 0 for r in scheduler.running) or scheduler.num_waiting:
        step(scheduler)
    prompt = rng.integers(1, config.model.vocab_size, _PROMPT_LEN.value).tolist()
    answer = scheduler.add_request(
        Request(f"req-{i}", prompt, SamplingParams(max_tokens=_MAX_TOKENS.value)))
    if not answer.admitted:
      raise ValueError(f"benchmark request {i} was not admitted: {answer.reason}")
  return scheduler


def step(scheduler: Scheduler) -> tuple[float, float]:
  """One host step with a fake sampler; returns (schedule, update) seconds."""
  start = time.perf_counter()
  out = scheduler.schedule()
  middle = time.perf_counter()
  sampled = {seq.request_id: 1 for seq in out.scheduled if seq.samples}  # the "executor"
  resume = time.perf_counter()
  scheduler.update(out, sampled)
  return middle - start, time.perf_counter() - resume


def summarize(seconds: list[float]) -> dict[str, float]:
  ms = np.asarray(seconds) * 1e3
  return dict(median_ms=float(np.median(ms)), p99_ms=float(np.percentile(ms, 99)),
              mean_ms=float(ms.mean()), max_ms=float(ms.max()))


def premises(config, scheduler: Scheduler) -> dict:
  sched = config.scheduler
  return dict(
      **environment.environment(),
      num_running=_NUM_RUNNING.value, num_waiting=_NUM_WAITING.value,
      prompt_len=_PROMPT_LEN.value, max_tokens=_MAX_TOKENS.value,
      num_steps=_NUM_STEPS.value, num_warmup=_NUM_WARMUP.value,
      num_pages=scheduler.page_pool.num_pages, page_size=config.cache.page_size,
      scheduler={key: sched[key] for key in sorted(sched.keys())})


def format_table(record: dict) -> str:
  p = record["premises"]
  knobs = p["scheduler"]
  lines = [
      "kvpage scheduler overhead (fake tokens, no model)",
      f"  machine      {p['processor']}, {p['cpu_count']} CPUs, {p['platform']}",
      f"  python       {p['python']}, numpy {p['packages']['numpy']}",
      f"  load         {p['num_running']} running + {p['num_waiting']} waiting; prompts of "
      f"{p['prompt_len']} tokens, {p['num_pages']:,} pages of {p['page_size']} tokens",
      f"  knobs        prefill={knobs['prefill_policy']} chunk={knobs['chunk_size']} "
      f"budget={knobs['max_num_batched_tokens']} max_num_seqs={knobs['max_num_seqs']} "
      f"preemption={knobs['preemption_mode']} watermark={knobs['watermark']}",
      f"  steps        {p['num_steps']} timed after {p['num_warmup']} warm-up",
      "",
      f"  {'part':<22}{'median ms':>12}{'p99 ms':>12}{'mean ms':>12}{'max ms':>12}",
  ]
  for part in ("step", "schedule", "update"):
    s = record["parts"][part]
    lines.append(f"  {part:<22}{s['median_ms']:>12.3f}{s['p99_ms']:>12.3f}"
                 f"{s['mean_ms']:>12.3f}{s['max_ms']:>12.3f}")
  verdict = "meets" if record["median_ms"] < record["target_ms"] else "MISSES"
  lines.append(f"\n  median step {record['median_ms']:.3f} ms {verdict} the "
               f"{record['target_ms']:g} ms target")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = cli.load_config(_CONFIG)
  scheduler = build(config)
  for _ in range(_NUM_WARMUP.value):
    step(scheduler)
  schedule_s, update_s = [], []
  for _ in range(_NUM_STEPS.value):
    s, u = step(scheduler)
    schedule_s.append(s)
    update_s.append(u)
  if scheduler.num_running != _NUM_RUNNING.value or scheduler.num_waiting != _NUM_WAITING.value:
    raise ValueError("the load changed during the measurement; raise --max_tokens")
  step_s = [s + u for s, u in zip(schedule_s, update_s, strict=True)]
  parts = dict(step=summarize(step_s), schedule=summarize(schedule_s),
               update=summarize(update_s))
  record = dict(median_ms=parts["step"]["median_ms"], p99_ms=parts["step"]["p99_ms"],
                target_ms=_TARGET_MS.value, parts=parts,
                premises=premises(config, scheduler),
                stdev_ms=statistics.pstdev(step_s) * 1e3)
  print(format_table(record))
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=2)
  print(f"\n  wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
