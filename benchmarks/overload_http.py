r"""Overload over HTTP: which admission line keeps a real server's TTFT within its SLO at 5x?

  python -m benchmarks.overload_http                 # 11 lines x 3 seeds: ~22 min on 2 cores
  python -m benchmarks.overload_http --smoke --out=/tmp/o.json   # the test's size, ~30 s

The issue's bullet (41): the real tiny-model server at 5x overload (steady arrivals,
128-token prompts, 64-token outputs, a KV pool far larger than the load needs) keeps the
TTFT p95 of the requests it serves within the TTFT SLO under the shipped default line,
while serving at least 30% of requests. With a pool that large the KV line never
triggers, because compute saturates first; this benchmark measures which line holds
then.

Each line is a server of its own, `python -m experiments.serve --config=...` with the
pool of `--kv_memory_gib` (1 GiB: 16,384 pages of 16 tokens for the tiny model, a
request needing 12), compiled before it listens, then warmed with a short load (which
also prices the steps the wait forecast needs) before any clock starts. The load comes
from `benchmarks.load_client` in this process: streamed `/v1/completions` requests of
`--prompt_len` random token ids asking for `--output_len` tokens (greedy, ignore_eos).
Retries are off by default (`--max_retries=0`), so a rejection counts as not served.
Every run on one server draws new prompts (its own seed), so no run hits prompts an
earlier one left in the prefix cache; the seeds of the overload runs are the same for
every line, so the lines see the same prompts at the same moments. With `--pin` (Linux,
two cores or more) the servers run on all cores but one and the load client on that one.

The rules, each a stated measurement on the server with no line at all
(`admission=queue_only`, no queue bound, every other line off):

  1. **Throughput** with everything at once: `--at_once_requests` offered at once,
     served requests / wall time.
  2. **SLOs** (the line study's rule, experiments/line_study.py): an unloaded run, a
     Poisson process at 0.05x that throughput; the TTFT SLO is 3x its TTFT p99, the
     TPOT SLO 3x its median TPOT, both as the client sees them over HTTP.
  3. **Sustainable rate, 1x** (`--capacity=search`, the line study's rule): the highest
     Poisson rate at which 90% of requests meet both SLOs with no line, found by
     `experiments.claims.search_capacity` from the throughput (grow, shrink, bisect to
     `--tolerance`); each probe offers `--probe_s` seconds of arrivals. Or
     (`--capacity=at_once`) the throughput itself.

Then, per line in `--lines`, at `--load` x the sustainable rate (steady Poisson,
`--overload_s` seconds of arrivals per seed, `--seeds` seeds), and once at `--low_load`
x (the refusals a line makes when nothing is overloaded): served fraction, TTFT
p50/p95/p99 of the served requests, TPOT p50, rejections by status and by cause (the
server's `x-kvpage-reject-reason`). A line meets the bullet when, in every seed, the TTFT
p95 of what it served is within the TTFT SLO and it served at least 30% of requests.

Lines (`--lines`): `default` (the server as shipped: nothing overridden but the pool,
so the config's scheduler section and its serving line `server.ttft_line_s`, which
configs/tiny.py sets; each server's record says which line it held), `none` (the no-line
server above, the serving line off too), `wait:F` (the default with
`max_forecast_ttft_s` = F x the TTFT SLO, in seconds, in place of the serving line),
`slowdown:S` (the default plus
`max_ttft_slowdown` = S: each request refused when its forecast first token comes later
than S x its own on an idle engine), `tokens:F` (the default plus
`max_inflight_tokens` = F x max_num_seqs x (prompt + output): the tokens of a full
running batch), and parts joined by `+`, which may also name `step_tokens:N` (the
default plus `max_num_batched_tokens` = N: a step's token budget, a batching knob that
bounds how long one step, and so a first token, takes).

`verdict` says, from the record's own numbers: whether the default holds; which lines
hold; and the recommended shipped default: of the single forecast-TTFT lines that hold
and refused nothing at low load, a `slowdown` line first (a ratio that means the same on
every deployment; a `wait` line's seconds come from this deployment's SLO), then the one
serving most. Prints a table and writes JSON (`--out`) with every premise: model config, dtype,
lengths, pool, arrival process, rates, SLO rule and values, this machine, versions.
"""

import json
import math
import pathlib

from absl import flags
from ml_collections import config_flags

from benchmarks import overload_rules as rules
from experiments import cli

_CONFIG = cli.define_config("configs/tiny.py", "Model config (random weights); its file "
                            "and any --config.KEY=VALUE overrides go to every server.")
_KV_GIB = flags.DEFINE_float("kv_memory_gib", 1.0, "KV pool of every server, GiB "
                             "(cache.kv_memory_gib, cache.num_pages=0): far more than the "
                             "load needs.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per request.")
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 64, "Output tokens per request (ignore_eos).")
_LOAD = flags.DEFINE_float("load", 5.0, "The overload, x the sustainable rate.")
_LOW_LOAD = flags.DEFINE_float("low_load", 1.0, "Each line is also run once at this load, "
                               "x the sustainable rate, to count its refusals there; 0 = skip.")
_OVERLOAD_S = flags.DEFINE_float("overload_s", 20.0, "Seconds of arrivals per run (at least "
                                 "--min_requests requests).")
_MIN_REQUESTS = flags.DEFINE_integer("min_requests", 40, "The fewest requests of a run.")
_MAX_REQUESTS = flags.DEFINE_integer("max_requests", 2000, "The most requests of a run.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Overload runs per line, seeds 0..N-1.")
_LINES = flags.DEFINE_list("lines", ["default", "none", "wait:0.25", "wait:0.5", "wait:1",
                                     "slowdown:3", "slowdown:4", "slowdown:6", "slowdown:10",
                                     "tokens:0.25", "wait:0.25+step_tokens:256"],
                           "Lines to run: default, none, wait:F (x the TTFT SLO), "
                           "slowdown:S (x each request's idle TTFT), "
                           "tokens:F (x a full running batch's tokens), or parts joined "
                           "by + (also step_tokens:N, a step's token budget).")
_CAPACITY = flags.DEFINE_enum("capacity", "search", ["search", "at_once"],
                              "The 1x rate: the line study's search, or the throughput with "
                              "everything at once.")
_AT_ONCE = flags.DEFINE_integer("at_once_requests", 256, "Requests offered at once for the "
                                "throughput.")
_UNLOADED = flags.DEFINE_integer("unloaded_requests", 200, "Requests of the unloaded run (the "
                                 "TTFT SLO is 3x their p99: 40 made it their maximum).")
_PROBE_S = flags.DEFINE_float("probe_s", 15.0, "Seconds of arrivals per capacity probe.")
_TOLERANCE = flags.DEFINE_float("tolerance", 0.1, "The capacity search's bracket, relative.")
_MAX_RETRIES = flags.DEFINE_integer("max_retries", 0, "Retries of a 429/503 (0: a rejection "
                                    "is not served).")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 300.0, "Wall bound of one load run.")
_PIN = flags.DEFINE_bool("pin", True, "Servers and load client on separate cores (Linux).")
_COMPILATION_CACHE = flags.DEFINE_string("compilation_cache", "workdir/jax_cache",
                                         "Persistent XLA compilation cache ('' = off).")
_SMOKE = flags.DEFINE_bool("smoke", False, "The smallest end-to-end run (the test's): a "
                           "small batch shape, a few dozen requests, one seed, lines "
                           "default and wait:1, the throughput as the 1x rate.")
_OUT = flags.DEFINE_string("out", "workdir/overload_http/result.json", "The JSON record.")


# The command.
def settings_from_flags() -> rules.Settings:
  """The run's sizes; `--config.KEY=VALUE` overrides travel to the servers as given."""
  overrides = tuple(flags.FLAGS[name].serialize() for name in flags.FLAGS
                    if name.startswith("config.") and flags.FLAGS[name].present)
  common = dict(config_file=config_flags.get_config_filename(flags.FLAGS["config"]),
                load=_LOAD.value, kv_memory_gib=_KV_GIB.value, probe_s=_PROBE_S.value,
                tolerance=_TOLERANCE.value, max_retries=_MAX_RETRIES.value,
                timeout_s=_TIMEOUT_S.value, pin=_PIN.value,
                compilation_cache=_COMPILATION_CACHE.value, smoke=_SMOKE.value)
  if _SMOKE.value:
    smoke = tuple(f"--config.scheduler.{key}={value}"
                  for key, value in rules.SMOKE_SCHEDULER.items())
    return rules.Settings(overrides=overrides + smoke, **common,  # type: ignore[arg-type]
                          **rules.SMOKE)
  return rules.Settings(overrides=overrides, **common, prompt_len=_PROMPT_LEN.value,
                        output_len=_OUTPUT_LEN.value, at_once_requests=_AT_ONCE.value,
                        unloaded_requests=_UNLOADED.value, overload_s=_OVERLOAD_S.value,
                        min_requests=_MIN_REQUESTS.value, max_requests=_MAX_REQUESTS.value,
                        seeds=_SEEDS.value, lines=_LINES.value, capacity=_CAPACITY.value,
                        low_load=_LOW_LOAD.value)


def check_settings(settings: rules.Settings) -> None:
  rules.check_lines(settings.lines)
  for name in ("prompt_len", "output_len", "at_once_requests", "unloaded_requests", "seeds",
               "min_requests", "max_requests"):
    if getattr(settings, name) < 1:
      raise cli.UsageError(f"--{name} must be at least 1, got {getattr(settings, name)}")
  for name in ("load", "overload_s", "kv_memory_gib", "probe_s", "tolerance", "timeout_s"):
    value = getattr(settings, name)
    if not 0 < value < math.inf:
      raise cli.UsageError(f"--{name} must be positive and finite, got {value}")
  if settings.max_requests < settings.min_requests:
    raise cli.UsageError(f"--max_requests ({settings.max_requests}) is below --min_requests "
                         f"({settings.min_requests})")
  if not 0 <= settings.low_load < math.inf:
    raise cli.UsageError(f"--low_load must be >= 0 (0 = skip), got {settings.low_load}")


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = cli.load_config(_CONFIG)
  settings = settings_from_flags()
  check_settings(settings)
  if _SMOKE.value:  # the same config here (premises) as in the servers
    config.scheduler.update(rules.SMOKE_SCHEDULER)
  output = pathlib.Path(_OUT.value)
  with cli.workdir(str(output.parent)) as directory:
    record = rules.run_benchmark(settings, config,
                                 progress=lambda line: print(line, flush=True))
    print(rules.table(record))
    cli.write_files(directory, {output.name: json.dumps(rules.plain(record), indent=2,
                                                        allow_nan=False)})
  print(f"wrote {output}")


if __name__ == "__main__":
  cli.run(main)
