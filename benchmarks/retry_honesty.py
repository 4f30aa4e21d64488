r"""Is the retry hint honest? The 13B simulation under overload, clients that obey it.

  python -m benchmarks.retry_honesty --out=retry_honesty.json

Finds the highest arrival rate that the simulated server takes without a rejection
(1x), then replays the workload at multiples of it with clients that retry exactly
when told: a rejected request is submitted again, same tokens and same id, at the
moment of its answer plus its `retry_after`, until it is admitted (or after
`--max_attempts`). For every rejection it also probes, at every later step boundary,
whether the same request, under its id (so with any reservation it holds), would be
admitted then (`AdmissionControl.admissible`, no side effects, before the arrivals of
the next window compete): the first boundary where it would be (or its retry's
admission, if that comes first) is the time after which a retry would actually have
been admitted.

The scheduler runs with `--retry_reservations` (on by default here, off in the
library: without it the server keeps no promise, so whoever comes first takes the
room a hint pointed at) and `--max_retry_after_s` (raised here: at 10x the honest wait
exceeds the 60 s default cap); both are printed and recorded with the other scheduler
knobs. `--loads` may include the knee just past 1x (`1.17` = 3.5 req/s by default),
the first load where anything is rejected.

Reports per load: the arrival rate, rejections, the share of rejected requests admitted
on their first honoured retry, and the median ratio of the hint to that actual time.
Prints a table and writes JSON with the premises.
"""

import json

from absl import flags
from ml_collections import config_flags

from benchmarks.retry_study import measure, sampling, setup
from configs import hardware as hardware_lib
from experiments import cli
from kvpage import premises
from kvpage.sim import replay, workload

_CONFIG = config_flags.DEFINE_config_file("config", "configs/llama_13b.py", "Model config.")
_HARDWARE = flags.DEFINE_string("hardware", "a100_80gb", "Simulated device.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 300, "Requests in each workload.")
_PROMPT_LEN = flags.DEFINE_string("prompt_len", "lognormal:512:3500", "Prompt lengths.")
_OUTPUT_LEN = flags.DEFINE_string("output_len", "uniform:64:512", "Output lengths.")
_LOADS = flags.DEFINE_list("loads", ["1", "3", "10"], "Multiples of the sustained rate.")
_BASE_RATE = flags.DEFINE_float("base_rate", 0.0, "The 1x rate (req/s); 0 = find it.")
_CANDIDATES = flags.DEFINE_list("candidate_rates", ["1", "1.5", "2", "2.5", "3", "3.5", "4"],
                                "Rates tried, in order, when finding the 1x rate.")
_MAX_ATTEMPTS = flags.DEFINE_integer("max_attempts", 100, "A client gives up after these.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")
_OUT = flags.DEFINE_string("out", "retry_honesty.json", "Where to write the JSON record.")
_RESERVATIONS = flags.DEFINE_bool("retry_reservations", True,
                                  "scheduler.retry_reservations for the overload runs.")
_MAX_HINT = flags.DEFINE_float("max_retry_after_s", 600.0,
                               "scheduler.max_retry_after_s for the overload runs.")


def trace_at(config, rate: float) -> list[workload.TraceRequest]:
  return workload.synthesize(num_requests=_NUM_REQUESTS.value, arrival_rate=rate,
                             prompt_len=_PROMPT_LEN.value, output_len=_OUTPUT_LEN.value,
                             vocab_size=config.model.vocab_size, seed=_SEED.value)


def rejections_without_retry(config, hardware, rate: float) -> int:
  engine = setup(config, hardware).engine
  replay.replay(engine, trace_at(config, rate), make_sampling=sampling)
  return engine.scheduler.stats()["num_rejections"]


def find_base_rate(config, hardware) -> tuple[float, dict[str, int]]:
  """The highest candidate rate with no rejection (each tried once, in order)."""
  tried, base = {}, 0.0
  for rate in map(float, _CANDIDATES.value):
    tried[str(rate)] = rejections_without_retry(config, hardware, rate)
    if tried[str(rate)]:
      break
    base = rate
  if not base:
    raise ValueError(f"every candidate rate was rejected at: {tried}")
  return base, tried


def run_load(config, hardware, rate: float) -> dict:
  """Replays the workload at `rate` with obedient retrying clients; the figures."""
  return measure(config, hardware, trace_at(config, rate), rate,
                 max_attempts=_MAX_ATTEMPTS.value)


def _fmt(value, spec: str) -> str:
  return "n/a" if value is None else format(value, spec)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = cli.load_config(_CONFIG)
  hardware = hardware_lib.get_hardware(_HARDWARE.value)
  base, tried = ((_BASE_RATE.value, {}) if _BASE_RATE.value
                 else find_base_rate(config, hardware))
  rows = {}
  # The 1x search runs with the defaults; the overload runs with the study's knobs.
  config.scheduler.retry_reservations = _RESERVATIONS.value
  config.scheduler.max_retry_after_s = _MAX_HINT.value
  for load in _LOADS.value:
    rows[load] = run_load(config, hardware, base * float(load))
  print(f"retry honesty: {config.model.name} on {hardware.name}, {_NUM_REQUESTS.value} requests, "
        f"prompt {_PROMPT_LEN.value}, output {_OUTPUT_LEN.value}; 1x = {base} req/s "
        f"(no rejection without retries; tried {tried}); "
        f"retry_reservations={config.scheduler.retry_reservations}, "
        f"max_retry_after_s={config.scheduler.max_retry_after_s}, "
        f"retry_jitter={config.scheduler.retry_jitter}")
  print(f"{'load':>5} {'req/s':>6} {'rejections':>10} {'requests':>8} {'1st retry ok':>12} "
        f"{'hint/actual p50':>15} {'p10..p90':>14} {'early':>6} {'at cap':>6}")
  for load, row in rows.items():
    spread = row["p10_p90_hint_over_actual"]
    print(f"{load + 'x':>5} {row['arrival_rate']:6.2f} {row['num_rejections']:10d} "
          f"{row['requests_rejected']:8d} {_fmt(row['first_retry_admitted'], '12.0%')} "
          f"{_fmt(row['median_hint_over_actual'], '15.2f')} "
          f"{'n/a' if spread is None else f'{spread[0]:.2f}..{spread[1]:.2f}':>14} "
          f"{_fmt(row['hints_earlier_than_actual'], '6.0%')} {row['hints_at_cap']:6d}")
  record = dict(
      config=config.model.name, hardware=hardware.name, num_requests=_NUM_REQUESTS.value,
      prompt_len=_PROMPT_LEN.value, output_len=_OUTPUT_LEN.value, seed=_SEED.value,
      base_rate=base, base_rate_search=tried, policies=config.scheduler.to_dict(),
      max_attempts=_MAX_ATTEMPTS.value, loads=rows, **premises.environment())
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=2)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
