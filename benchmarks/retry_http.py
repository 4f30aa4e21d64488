r"""Are the retry hints honest over HTTP? The real tiny-model server at 3x and 10x, with
clients that do exactly what they are told.

  python -m benchmarks.retry_http                      # 2 loads x 2 client kinds, ~5 min
  python -m benchmarks.retry_http --smoke --out=/tmp/r.json   # the test's size, ~1 min

One server, `python -m experiments.serve --config=configs/tiny.py` (random weights,
compiled and warmed before any clock), holds every line a refused client can meet:

  * the forecast-TTFT line it ships (`server.ttft_line_s`): 429 `wait_forecast`;
  * the KV watermark over its pool (`--num_pages` pages of 16 tokens; a request takes
    `prompt_len + output_len` tokens): 503 `kv_pressure`;
  * a bounded waiting queue (`--max_waiting`): 429 `queue_full`;
  * in the runs whose clients name one, their own `max_queue_wait_s` (`--deadline_s`):
    429 `wait_deadline`.

The 1x rate is the throughput with everything at once (`--at_once_requests` offered
together to the same server with every line off, running as many at once as its pool
holds whole, so that it does not thrash in preemptions: served / wall time). At each load in
`--loads`, `--overload_s` seconds of Poisson arrivals run twice: plain clients, then
clients with a deadline. The clients
are `benchmarks.load_client`'s: streamed completions of `--prompt_len` random token
ids, `--output_len` tokens each (greedy, ignore_eos), and a refused request sleeps
exactly its hint (`retry-after-ms`) and is sent again, up to `--max_retries` times.

Three figures per load and rejection reason, each with the issue's bar:

  * **First-retry admission** (at least 80%): of the requests whose first attempt was
    refused for this reason, the share admitted on their first retry at the hint.
  * **Hint / needed** (median at most 2): the hint over the wait the refused request
    really needed. The server finds that wait itself (`kvpage.host.retry_audit`, on for
    `serve`): after every step it asks whether the same request arriving now would be
    admitted (every line, no side effects), and reports hint / needed per reason on
    `/metrics` (`kvpage:retry_hint_ratio`), read here before and after each run. Its
    buckets bound the median (the bucket holding it is printed); the bar is judged
    exactly, as the share of ratios at most 2 (the 2.0 bucket's edge). A refusal the
    audit could not watch (`server.retry_audit` were open) is counted as skipped.
  * **ETA** (at least 80% within a factor of 2): of the admitted requests told they
    wait (a status chunk in `queueing` state, asked for with `include_status`: sent at
    admission, then every `--status_interval_s`), the share whose first token came
    within a factor of 2 of the first status's `eta_s`, both from that status's arrival.

Prints a table and writes JSON (`--out`) with the premises: model config, dtype,
lengths, pool, lines, arrival process, rates, this machine and versions.
"""

import json
import math
import pathlib

from absl import flags
from ml_collections import config_flags

from benchmarks import overload_rules as rules
from benchmarks import retry_rules
from benchmarks.retry_rules import SMOKE, SMOKE_SCHEDULER, Settings
from experiments import cli

_CONFIG = cli.define_config("configs/tiny.py", "Model config (random weights); its file "
                            "and any --config.KEY=VALUE overrides go to the server.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 256, "The server's KV pool, pages of 16 tokens.")
_MAX_WAITING = flags.DEFINE_integer("max_waiting", 8, "The server's waiting-queue bound.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per request.")
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 128, "Output tokens per request (ignore_eos).")
_LOADS = flags.DEFINE_list("loads", ["3", "10"], "Loads, x the throughput with everything "
                           "at once.")
_OVERLOAD_S = flags.DEFINE_float("overload_s", 20.0, "Seconds of arrivals per run.")
_MAX_REQUESTS = flags.DEFINE_integer("max_requests", 1500, "The most requests of a run.")
_AT_ONCE = flags.DEFINE_integer("at_once_requests", 128, "Requests offered at once for the "
                                "1x rate.")
_ONE_X = flags.DEFINE_float("one_x_per_s", 0.0, "The 1x rate, req/s, instead of measuring it "
                            "(to repeat a run at the same rates); 0 = measure it.")
_DEADLINE_S = flags.DEFINE_float("deadline_s", 1.0, "max_queue_wait_s of the deadline runs' "
                                 "clients; 0 = no deadline runs.")
_MAX_RETRIES = flags.DEFINE_integer("max_retries", 30, "Retries of a refused request.")
_STATUS_INTERVAL_S = flags.DEFINE_float("status_interval_s", 0.05, "The server's status "
                                        "interval (a waiting stream's first ETA comes then).")
_AUDIT = flags.DEFINE_integer("retry_audit", 512, "Refusals the server's audit watches at once.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 300.0, "Wall bound of one load run.")
_PIN = flags.DEFINE_bool("pin", True, "Server and load client on separate cores (Linux).")
_COMPILATION_CACHE = flags.DEFINE_string("compilation_cache", "workdir/jax_cache",
                                         "Persistent XLA compilation cache ('' = off).")
_SMOKE = flags.DEFINE_bool("smoke", False, "The smallest end-to-end run (the test's): "
                           "short requests, one load, a few seconds of arrivals.")
_OUT = flags.DEFINE_string("out", "workdir/retry_http/result.json", "The JSON record.")

def settings_from_flags() -> Settings:
  values = dict(prompt_len=_PROMPT_LEN.value, output_len=_OUTPUT_LEN.value,
                loads=_LOADS.value, overload_s=_OVERLOAD_S.value,
                max_requests=_MAX_REQUESTS.value, at_once_requests=_AT_ONCE.value,
                one_x_per_s=_ONE_X.value,
                num_pages=_NUM_PAGES.value, max_waiting=_MAX_WAITING.value)
  if _SMOKE.value:
    values.update(SMOKE)
  try:
    loads = tuple(float(load) for load in values.pop("loads"))
  except ValueError:
    raise cli.UsageError(f"--loads must be numbers, got {_LOADS.value}") from None
  overrides = tuple(flags.FLAGS[name].serialize() for name in flags.FLAGS
                    if name.startswith("config.") and flags.FLAGS[name].present)
  if _SMOKE.value:
    overrides += tuple(f"--config.scheduler.{key}={value}"
                       for key, value in SMOKE_SCHEDULER.items())
  settings = Settings(config_file=config_flags.get_config_filename(flags.FLAGS["config"]),
                      overrides=overrides, loads=loads, deadline_s=_DEADLINE_S.value,
                      max_retries=_MAX_RETRIES.value,
                      status_interval_s=_STATUS_INTERVAL_S.value, retry_audit=_AUDIT.value,
                      timeout_s=_TIMEOUT_S.value, pin=_PIN.value,
                      compilation_cache=_COMPILATION_CACHE.value, smoke=_SMOKE.value, **values)
  if not 0 <= settings.one_x_per_s < math.inf:
    raise cli.UsageError(f"--one_x_per_s must be >= 0 (0 = measure it), got "
                         f"{settings.one_x_per_s}")
  for name in ("overload_s", "status_interval_s", "timeout_s"):
    if not 0 < getattr(settings, name) < math.inf:
      raise cli.UsageError(f"--{name} must be positive and finite, got "
                           f"{getattr(settings, name)}")
  if not loads or not all(0 < load < math.inf for load in loads):
    raise cli.UsageError(f"--loads must be positive and finite, got {_LOADS.value}")
  if not 0 <= settings.deadline_s < math.inf:
    raise cli.UsageError(f"--deadline_s must be >= 0 (0 = no deadline runs), got "
                         f"{settings.deadline_s}")
  for name, least in (("max_requests", 1), ("at_once_requests", 1), ("num_pages", 2),
                      ("max_waiting", 1), ("max_retries", 1), ("retry_audit", 1),
                      ("prompt_len", 1), ("output_len", 2)):
    if getattr(settings, name) < least:
      raise cli.UsageError(f"--{name} must be at least {least}, got {getattr(settings, name)}")
  return settings


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = cli.load_config(_CONFIG)
  settings = settings_from_flags()
  if settings.smoke:  # the same config here (premises) as in the server
    config.scheduler.update(SMOKE_SCHEDULER)
  output = pathlib.Path(_OUT.value)
  with cli.workdir(str(output.parent)) as directory:
    record = retry_rules.run_benchmark(settings, config,
                                       progress=lambda line: print(line, flush=True))
    print(retry_rules.table_rows(record["runs"]))
    cli.write_files(directory, {output.name: json.dumps(rules.plain(record), indent=2,
                                                        allow_nan=False)})
  print(f"wrote {output}")


if __name__ == "__main__":
  cli.run(main)
