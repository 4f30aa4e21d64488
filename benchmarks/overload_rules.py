r"""The lines, rules and verdict of `benchmarks/overload_http.py` (its docstring has the
whole method): servers, loads, the no-line measurements, each line's runs, the judgement
and the report. No flags here: the command parses them, and tests import this.
"""

import asyncio
import collections
import contextlib
import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks import load_client
from benchmarks.load_client import LoadConfig, LoadResult
from benchmarks.processes import core_split
from configs import scheduler as scheduler_defaults
from experiments import claims, cli
from kvpage import premises

# The rules, stated once (and recorded).
UNLOADED = 0.05  # the unloaded run's rate, x the throughput with everything at once
SLO_FACTOR = 3.0  # each SLO is this many times the unloaded run's figure
ATTAINMENT = 0.9  # sustainable: this share of requests within both SLOs, with no line
SEARCH_REACH = 8.0  # the capacity search stops at this many times the throughput
MIN_SERVED = 0.30  # the bullet: at least this share of requests served
WARMUP_REQUESTS = 16  # offered at once to each new server before its first clock
# The smoke run: a small batch (fewer, cheaper programs to compile), a few dozen requests.
SMOKE_SCHEDULER = dict(max_num_seqs=8, max_num_batched_tokens=256)
SMOKE = dict(prompt_len=32, output_len=8, at_once_requests=16, unloaded_requests=6,
             overload_s=1.0, min_requests=12, max_requests=24, seeds=1,
             lines=["default", "wait:1"], capacity="at_once", low_load=1.0,
             warmup_requests=4)
# The no-line server: every line of configs/scheduler.py off, and the server's own
# forecast-TTFT line (`server.ttft_line_s`, a dotted config path) too.
NO_LINE = {"admission": "queue_only", "max_waiting": 0, "rate_limit": 0.0,
           "max_concurrent": 0, "max_inflight_tokens": 0, "max_forecast_ttft_s": 0.0,
           "max_ttft_slowdown": 0.0, "server.ttft_line_s": 0.0}
ADMISSION_LINE = "kvpage serve: lines held: "  # what a server says it holds, at start
# The parts of a line: wait:F (x the TTFT SLO, seconds), tokens:F (x a full running
# batch's tokens), step_tokens:N (a step's token budget; batching, not admission),
# slowdown:S (max_ttft_slowdown: S x each request's own idle time to first token).
PART_KEYS = {"wait": "max_forecast_ttft_s", "tokens": "max_inflight_tokens",
             "step_tokens": "max_num_batched_tokens", "slowdown": "max_ttft_slowdown"}


@dataclasses.dataclass(frozen=True)
class Settings:
  """One benchmark run's settings (the command's flags, or the smoke run's sizes)."""

  config_file: str  # the model config every server loads
  overrides: tuple[str, ...]  # --config.KEY=VALUE flags for every server
  prompt_len: int
  output_len: int
  at_once_requests: int
  unloaded_requests: int
  overload_s: float
  min_requests: int
  max_requests: int
  seeds: int
  lines: list[str]
  capacity: str  # "search" or "at_once"
  low_load: float  # x the sustainable rate; 0 = no low-load run
  load: float = 5.0  # the overload, x the sustainable rate
  kv_memory_gib: float = 1.0
  probe_s: float = 15.0  # seconds of arrivals per capacity probe
  tolerance: float = 0.1  # the capacity search's bracket, relative
  max_retries: int = 0
  timeout_s: float = 300.0  # wall bound of one load run
  pin: bool = True  # servers and load client on separate cores (Linux)
  compilation_cache: str = ""
  smoke: bool = False
  warmup_requests: int = WARMUP_REQUESTS


# Lines.
def line_settings(line: str, slo_ttft_s: float, batch_tokens: int) -> dict[str, Any]:
  """The scheduler keys a line sets over the shipped defaults (`none`: every line off);
  parts joined by `+` combine (`wait:0.25+step_tokens:256`)."""
  if line == "default":
    return {}
  if line == "none":
    return dict(NO_LINE)
  settings: dict[str, Any] = {}
  for part in line.split("+"):
    kind, _, factor = part.partition(":")
    try:
      value = float(factor)
    except ValueError:
      value = math.nan
    if (kind not in PART_KEYS or not 0 < value < math.inf or PART_KEYS[kind] in settings
        or (kind == "step_tokens" and not value.is_integer())
        or (kind == "slowdown" and value < 1)):
      raise cli.UsageError(f"--lines: {line!r} is not default, none, or parts wait:F, "
                           "tokens:F, step_tokens:N, slowdown:S (F > 0, N a whole number, S >= 1) "
                           "joined by +, "
                           "each kind once")
    settings[PART_KEYS[kind]] = (round(value * slo_ttft_s, 4) if kind == "wait" else
                                 max(1, round(value * batch_tokens)) if kind == "tokens" else
                                 value if kind == "slowdown" else int(value))
  return settings


def describe(settings: Mapping[str, Any]) -> str:
  """A line's settings, short: `wait 0.0462 s, step tokens 256`."""
  names = {"max_forecast_ttft_s": ("wait ", " s"), "max_inflight_tokens": ("tokens ", ""),
           "max_num_batched_tokens": ("step tokens ", ""),
           "max_ttft_slowdown": ("slowdown ", "x")}
  if settings == NO_LINE:
    return "no line"
  return ", ".join(f"{names[key][0]}{value}{names[key][1]}" if key in names
                   else f"{key}={value}" for key, value in settings.items()) or "shipped"


def check_lines(lines: Sequence[str]) -> None:
  """Refuses an unknown or repeated line before any server starts."""
  if not lines:
    raise cli.UsageError("--lines names no line")
  if len(set(lines)) != len(lines):
    raise cli.UsageError(f"--lines repeats a line: {list(lines)}")
  for line in lines:
    line_settings(line, 1.0, 1)


# Servers.
class Server:
  """`python -m experiments.serve` on 127.0.0.1, a free port, `cores`; stopped by `stop`."""

  def __init__(self, flags_: Sequence[str], cores: set[int] | None, timeout_s: float = 600):
    command = [sys.executable, "-m", "experiments.serve", "--host=127.0.0.1", "--port=0",
               "--warmup_sampling=false", *flags_]
    self.command = command
    pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))
    self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, preexec_fn=pin)
    self.lines: list[str] = []
    self.stderr: list[str] = []
    threading.Thread(target=self.stderr.extend, args=(self.process.stderr,),
                     daemon=True).start()
    self.url, self.num_pages, self.admission = "", 0, ""
    deadline = time.monotonic() + timeout_s
    assert self.process.stdout is not None
    try:
      for line in self.process.stdout:
        self.lines.append(line)
        if line.startswith(ADMISSION_LINE):
          self.admission = line[len(ADMISSION_LINE):].strip()
        found = re.search(r" on (http://127\.0\.0\.1:\d+) .*?([\d,]+) KV pages", line)
        if found:
          self.url, self.num_pages = found.group(1), int(found.group(2).replace(",", ""))
          break
        if time.monotonic() > deadline:
          break
      if not self.url:
        raise RuntimeError(f"the server did not listen ({' '.join(command)}):\n"
                           f"{''.join(self.lines)}{''.join(self.stderr[-20:])}")
    except BaseException:
      self.stop()
      raise
    threading.Thread(target=self.lines.extend, args=(self.process.stdout,),
                     daemon=True).start()

  def stop(self, timeout_s: float = 60) -> int:
    """SIGTERM (a drain), then a kill if it has not exited within `timeout_s`."""
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
    try:
      return self.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
      self.process.kill()
      return self.process.wait()


@contextlib.contextmanager
def started(flags_: Sequence[str], cores: set[int] | None) -> Iterator[Server]:
  """A server for the length of the block, stopped however the block ends."""
  server = Server(flags_, cores)
  try:
    yield server
  finally:
    server.stop()


# Loads.
def num_requests(rate: float, seconds: float, least: int, most: int) -> int:
  """Requests in `seconds` of arrivals at `rate`, within [`least`, `most`]."""
  return min(most, max(least, round(rate * seconds)))


def run_load(config: LoadConfig) -> tuple[LoadResult, dict[str, int]]:
  """One load; its result and its rejections by the server's reason."""
  result = asyncio.run(load_client.run_load(config))
  reasons = collections.Counter(attempt.reason or "unstated" for record in result.requests
                                for attempt in record.attempts
                                if attempt.status in load_client.RETRYABLE_STATUSES)
  return result, dict(sorted(reasons.items()))


def _percentile(values: Sequence[float], q: float) -> float | None:
  return float(np.percentile(values, q)) if values else None


def figures(result: LoadResult, reasons: Mapping[str, int],
            slos: Mapping[str, float] | None = None) -> dict[str, Any]:
  """A run's figures: served fraction, TTFT p50/p95/p99 and TPOT p50 of the served
  requests, rejections by status and reason, other failures; with `slos`, the share of
  all requests served within both SLOs (goodput fraction)."""
  summary = load_client.summarize(result)
  served = [r for r in result.requests if r.outcome == "served"]
  ttfts = [r.ttft_s for r in served if r.ttft_s is not None]
  tpots = [r.tpot_s for r in served if r.tpot_s is not None]
  total = len(result.requests)
  row = dict(num_requests=total, served=len(served), served_fraction=len(served) / total,
             ttft_p50_s=_percentile(ttfts, 50), ttft_p95_s=_percentile(ttfts, 95),
             ttft_p99_s=_percentile(ttfts, 99), tpot_p50_s=_percentile(tpots, 50),
             rejections=summary["rejections"], rejection_reasons=dict(reasons),
             num_rejections=summary["num_rejections"], failures=summary["failures"],
             unfinished=summary["unfinished"], wall_s=result.wall_s,
             served_per_s=len(served) / result.wall_s if result.wall_s > 0 else None,
             output_tokens_per_s=summary["output_tokens_per_s"])
  if slos is not None:
    good = sum(r.ttft_s is not None and r.ttft_s <= slos["ttft_s"]
               and (r.tpot_s is None or r.tpot_s <= slos["tpot_s"]) for r in served)
    row["goodput_fraction"] = good / total
  return row


class Loads:
  """Loads against servers, each run with seeds never used before on the same server."""

  def __init__(self, settings: Settings, vocab_size: int):
    self.settings = settings
    self.vocab_size = vocab_size
    self._next_seed: dict[str, int] = {}

  def config(self, server: Server, *, rate: float, count: int, seed: int) -> LoadConfig:
    return LoadConfig(url=server.url, num_requests=count, request_rate=rate,
                      prompt_len=self.settings.prompt_len, output_len=self.settings.output_len,
                      min_token_id=1, max_token_id=self.vocab_size, ignore_eos=True,
                      temperature=0.0, seed=seed, max_retries=self.settings.max_retries,
                      timeout_s=self.settings.timeout_s)

  def fresh_seed(self, server: Server) -> int:
    """A seed this server has not seen (1000 up: the overload runs use 0..seeds-1)."""
    seed = self._next_seed.get(server.url, 1000)
    self._next_seed[server.url] = seed + 1
    return seed

  def run(self, server: Server, *, rate: float, count: int, seed: int | None = None,
          slos: Mapping[str, float] | None = None) -> dict[str, Any]:
    """`count` requests at `rate` (Poisson; inf = at once); the figures, with the
    settings."""
    seed = self.fresh_seed(server) if seed is None else seed
    result, reasons = run_load(self.config(server, rate=rate, count=count, seed=seed))
    return dict(rate=rate, seed=seed, **figures(result, reasons, slos))

  def warm(self, server: Server) -> None:
    """A few requests at once, before any clock: connections opened, steps priced."""
    self.run(server, rate=math.inf, count=self.settings.warmup_requests)


# The rules.
def measure_no_line(loads: Loads, server: Server, settings: Settings) -> dict[str, Any]:
  """Throughput with everything at once, the SLOs from an unloaded run, and the
  sustainable (1x) rate, all on the no-line server."""
  at_once = loads.run(server, rate=math.inf, count=settings.at_once_requests)
  throughput = at_once["served"] / at_once["wall_s"]
  unloaded_rate = UNLOADED * throughput
  unloaded = loads.run(server, rate=unloaded_rate, count=settings.unloaded_requests)
  slos = dict(ttft_s=round(SLO_FACTOR * unloaded["ttft_p99_s"], 4),
              tpot_s=round(SLO_FACTOR * unloaded["tpot_p50_s"], 4))
  probes: list[dict[str, Any]] = []
  measured = dict(throughput_at_once_per_s=throughput, at_once=at_once,
                  unloaded_rate_per_s=unloaded_rate, unloaded=unloaded,
                  slo_ttft_s=slos["ttft_s"], slo_tpot_s=slos["tpot_s"],
                  capacity_rule=settings.capacity, probes=probes)
  if settings.capacity == "at_once":
    measured["sustainable_per_s"] = throughput
    return measured

  def meets(rate: float) -> bool:
    count = num_requests(rate, settings.probe_s, settings.min_requests,
                         settings.max_requests)
    row = loads.run(server, rate=rate, count=count, slos=slos)
    probes.append(row)
    print(f"  capacity probe {rate:7.2f} req/s: {row['goodput_fraction']:.0%} within both "
          f"SLOs", flush=True)
    return row["goodput_fraction"] >= ATTAINMENT

  found = claims.search_capacity(meets, throughput, max_rate=SEARCH_REACH * throughput,
                                 min_rate=unloaded_rate, relative_tolerance=settings.tolerance)
  measured["capacity_search"] = found.to_dict()
  measured["sustainable_per_s"] = found.rate or unloaded_rate
  return measured


def spread(runs: Sequence[Mapping[str, Any]], key: str) -> dict[str, float | None]:
  """Mean, min and max of a figure over runs (None where a run has none)."""
  values = [run[key] for run in runs if run.get(key) is not None]
  if not values:
    return dict(mean=None, min=None, max=None)
  return dict(mean=float(np.mean(values)), min=float(min(values)), max=float(max(values)))


def meets_bullet(run: Mapping[str, Any], slo_ttft_s: float,
                 min_served: float = MIN_SERVED) -> bool:
  """One run meets the bullet: its served TTFT p95 within the SLO, enough served."""
  p95 = run["ttft_p95_s"]
  return p95 is not None and p95 <= slo_ttft_s and run["served_fraction"] >= min_served


def judge(lines: Mapping[str, Mapping[str, Any]], slo_ttft_s: float,
          min_served: float = MIN_SERVED) -> dict[str, Any]:
  """The verdict, from the lines' own runs: which lines meet the bullet in every seed,
  whether the default does, and the recommended default: among the single forecast-TTFT
  lines (`slowdown:S` or `wait:F`) that hold and refused nothing at low load, a
  `slowdown` line first (a ratio, the same on every deployment, where a `wait` line is
  seconds that only this deployment's SLO sets), then the one serving the most on
  average; None if there is none."""
  holding = {name: all(meets_bullet(run, slo_ttft_s, min_served) for run in line["runs"])
             and bool(line["runs"]) for name, line in lines.items()}
  quiet = {name: line.get("low_load") is not None and line["low_load"]["num_rejections"] == 0
           for name, line in lines.items()}
  candidates = [name for name in lines if name.startswith(("wait:", "slowdown:"))
                and "+" not in name and holding[name] and quiet[name]]
  served = lambda name: float(np.mean([run["served_fraction"] for run in lines[name]["runs"]]))
  recommended = max(candidates, key=lambda name: (name.startswith("slowdown:"), served(name),
                                                  name), default=None)
  return dict(
      criterion=f"TTFT p95 of served requests <= {slo_ttft_s} s and served >= "
                f"{min_served:.0%}, in every seed",
      default_holds=holding.get("default"), holds=holding, quiet_at_low_load=quiet,
      recommended=recommended,
      recommended_settings=dict(lines[recommended]["settings"]) if recommended else None)


# The report.
def _ms(value: float | None) -> str:
  return "n/a" if value is None else f"{1000 * value:.0f}"


def _range(figure: Mapping[str, float | None], scale: float = 1000.0, spec: str = ".0f") -> str:
  values = [figure[k] for k in ("mean", "min", "max")]
  if any(value is None for value in values):
    return "n/a"
  mean, low, high = (format(scale * value, spec) for value in values if value is not None)
  return mean if low == high else f"{mean} ({low}-{high})"


def table(record: Mapping[str, Any]) -> str:
  """The lines at the overload: means over seeds, (min-max) where they differ."""
  measured, overload = record["measured"], record["overload"]
  lines = [
      f"overload_http: {overload['load']:g}x = {overload['rate_per_s']:.2f} req/s "
      f"(1x = {measured['sustainable_per_s']:.2f} req/s by rule '{measured['capacity_rule']}'; "
      f"at once {measured['throughput_at_once_per_s']:.2f} req/s), "
      f"{overload['num_requests']} requests x {len(overload['seeds'])} seeds; "
      f"TTFT SLO {1000 * measured['slo_ttft_s']:.0f} ms, TPOT SLO "
      f"{1000 * measured['slo_tpot_s']:.1f} ms",
      f"{'line':<24} {'setting':<30} {'served %':>14} {'TTFT p50 ms':>15} "
      f"{'TTFT p95 ms':>17} {'TTFT p99 ms':>17} {'TPOT p50 ms':>12} {'rejections':<28} "
      f"{'meets':>5} {'low-load rej.':>13}"]
  verdict = record["verdict"]
  for name, line in record["lines"].items():
    setting = describe(line["settings"])
    reasons = collections.Counter[str]()
    for run in line["runs"]:
      reasons.update(run["rejection_reasons"])
    low = line.get("low_load")
    lines.append(
        f"{name:<24} {setting:<30} {_range(line['summary']['served_fraction'], 100):>14} "
        f"{_range(line['summary']['ttft_p50_s']):>15} {_range(line['summary']['ttft_p95_s']):>17} "
        f"{_range(line['summary']['ttft_p99_s']):>17} "
        f"{_range(line['summary']['tpot_p50_s'], spec='.1f'):>12} "
        f"{', '.join(f'{k}: {v}' for k, v in reasons.items()) or 'none':<28} "
        f"{'yes' if verdict['holds'][name] else 'no':>5} "
        f"{'n/a' if low is None else low['num_rejections']:>13}")
  lines.append(f"verdict: {verdict['criterion']}: default "
               f"{'holds' if verdict['default_holds'] else 'fails'}; recommended default: "
               + (f"{describe(verdict['recommended_settings'])} ({verdict['recommended']})"
                  if verdict["recommended"] else "none"))
  return "\n".join(lines)


def run_benchmark(settings: Settings, config: Any, progress: Callable[[str], None] = print
                  ) -> dict[str, Any]:
  """Measures the rules on the no-line server, then every line; the record."""
  config_file = settings.config_file
  server_cores, client_cores = core_split(settings.pin)
  if client_cores is not None:  # the load client (this process) on its own core
    os.sched_setaffinity(0, client_cores)
  shared = [f"--config={config_file}", *settings.overrides, "--num_pages=0",
            f"--config.cache.kv_memory_gib={settings.kv_memory_gib}",
            "--config.cache.fit_pool=false",  # the budget as given: far more than is needed
            f"--compilation_cache={settings.compilation_cache}"]
  scheduler = config.scheduler
  batch_tokens = scheduler.max_num_seqs * (settings.prompt_len + settings.output_len)
  loads = Loads(settings, config.model.vocab_size)

  def line_flags(values: Mapping[str, Any]) -> list[str]:
    return [*shared, *(f"--config.{key if '.' in key else 'scheduler.' + key}={value}"
                       for key, value in values.items())]

  started_at = time.time()
  with started(line_flags(NO_LINE), server_cores) as base:
    progress(f"no-line server on {base.url}: {base.num_pages:,} KV pages")
    loads.warm(base)
    measured = measure_no_line(loads, base, settings)
    progress(f"throughput at once {measured['throughput_at_once_per_s']:.2f} req/s; SLOs "
             f"TTFT {measured['slo_ttft_s']} s, TPOT {measured['slo_tpot_s']} s; 1x = "
             f"{measured['sustainable_per_s']:.2f} req/s")
    num_pages = base.num_pages
    server_models = asyncio.run(_models(base.url))
    rate = settings.load * measured["sustainable_per_s"]
    count = num_requests(rate, settings.overload_s, settings.min_requests,
                         settings.max_requests)
    low_rate = settings.low_load * measured["sustainable_per_s"]
    low_count = num_requests(low_rate, settings.overload_s, settings.min_requests,
                             settings.max_requests)
    seeds = list(range(settings.seeds))

    def run_line(server: Server) -> dict[str, Any]:
      loads.warm(server)
      low = (loads.run(server, rate=low_rate, count=low_count) if settings.low_load
             else None)
      runs = [loads.run(server, rate=rate, count=count, seed=seed) for seed in seeds]
      return dict(server_admission=server.admission, low_load=low, runs=runs)

    lines: dict[str, Any] = {}
    if "none" in settings.lines:  # the no-line server is that line's server
      lines["none"] = run_line(base)
  for name in settings.lines:
    values = line_settings(name, measured["slo_ttft_s"], batch_tokens)
    if name != "none":
      with started(line_flags(values), server_cores) as server:
        lines[name] = run_line(server)
    lines[name]["settings"] = values
    lines[name]["summary"] = {key: spread(lines[name]["runs"], key) for key in (
        "served_fraction", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "tpot_p50_s",
        "num_rejections")}
    summary = lines[name]["summary"]
    progress(f"{name}: served {100 * summary['served_fraction']['mean']:.0f}%, TTFT p95 "
             f"{_ms(summary['ttft_p95_s']['mean'])} ms (SLO {_ms(measured['slo_ttft_s'])} ms)")
  lines = {name: lines[name] for name in settings.lines}
  defaults = scheduler_defaults.get_scheduler_config()
  record = dict(
      benchmark="overload_http", smoke=settings.smoke,
      measured=measured,
      overload=dict(load=settings.load, rate_per_s=rate, num_requests=count, seeds=seeds,
                    low_load=settings.low_load, low_load_rate_per_s=low_rate,
                    low_load_num_requests=low_count, arrival_process="poisson"),
      lines=lines,
      verdict=judge(lines, measured["slo_ttft_s"]),
      rules=dict(unloaded=f"Poisson at {UNLOADED}x the throughput with everything at once",
                 slo=f"{SLO_FACTOR}x the unloaded run's TTFT p99 and median TPOT, at the "
                     "client over HTTP",
                 sustainable=(f"highest Poisson rate at which {ATTAINMENT:.0%} of requests "
                              "meet both SLOs with no line (claims.search_capacity)"
                              if settings.capacity == "search" else
                              "the throughput with everything at once"),
                 min_served_fraction=MIN_SERVED, warmup_requests=settings.warmup_requests),
      premises=dict(
          config=config_file, overrides=list(settings.overrides), model=config.model.to_dict(),
          dtype=config.model.dtype, kv_dtype=config.cache.kv_dtype,
          prompt_len=settings.prompt_len, output_len=settings.output_len, ignore_eos=True,
          temperature=0.0, kv_memory_gib=settings.kv_memory_gib, num_pages=num_pages,
          page_size=config.cache.page_size,
          pages_per_request=math.ceil((settings.prompt_len + settings.output_len)
                                      / config.cache.page_size),
          full_batch_tokens=batch_tokens, max_retries=settings.max_retries,
          shipped_scheduler=defaults.to_dict(), scheduler=scheduler.to_dict(),
          server=config.server.to_dict(),
          server_models=server_models, server_cores=sorted(server_cores or []),
          client_cores=sorted(client_cores or []), wall_s=time.time() - started_at,
          **premises.environment()))
  return record


def plain(value: Any) -> Any:
  """`value` with every non-finite float as a string (JSON has no infinity)."""
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if isinstance(value, dict):
    return {key: plain(item) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [plain(item) for item in value]
  return value


async def _models(url: str) -> Any:
  import aiohttp

  async with aiohttp.ClientSession(trust_env=False) as client, client.get(
      url + "/v1/models") as response:
    return await response.json(content_type=None)
