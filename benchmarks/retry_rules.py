"""The measurement of `benchmarks/retry_http.py` (its docstring has the method), without
flags: the runs, what the clients saw, what the server's audit found, and the verdict.
Tests import this; the command parses the flags.
"""

import asyncio
import collections
import dataclasses
import math
import os
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from benchmarks import load_client
from benchmarks import overload_rules as rules
from benchmarks.load_client import LoadConfig, RequestRecord
from kvpage import premises
from kvpage.units import cdiv

SMOKE = dict(prompt_len=32, output_len=16, loads=["10"], overload_s=3.0, at_once_requests=24,
             max_requests=150, num_pages=48, max_waiting=4)
SMOKE_SCHEDULER = dict(max_num_seqs=8, max_num_batched_tokens=256)
FIRST_RETRY_BAR = 0.8  # first-retry admission, per reason
RATIO_BAR = 2.0  # the median hint / needed, per reason
ETA_FACTOR, ETA_BAR = 2.0, 0.8  # the ETA within this factor, for this share
WARMUP_REQUESTS = 16


@dataclasses.dataclass(frozen=True)
class Settings:
  """One run's settings (the command's flags, or the smoke run's sizes)."""

  config_file: str  # the model config the server loads
  overrides: tuple[str, ...]  # --config.KEY=VALUE flags for the server
  prompt_len: int
  output_len: int
  loads: tuple[float, ...]
  overload_s: float
  max_requests: int
  at_once_requests: int
  one_x_per_s: float  # the 1x rate given (0: measured, at once)
  num_pages: int
  max_waiting: int
  deadline_s: float
  max_retries: int
  status_interval_s: float
  retry_audit: int
  timeout_s: float
  pin: bool
  compilation_cache: str
  smoke: bool


# What the clients saw.
def first_retries(records: Iterable[RequestRecord]) -> dict[str, dict[str, Any]]:
  """Per reason of a request's first refusal: how many were refused first for it, how
  many retried at the hint, and the share of those admitted on that retry."""
  out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for record in records:
    attempts = record.attempts
    if not attempts or attempts[0].status not in load_client.RETRYABLE_STATUSES:
      continue
    counts = out[attempts[0].reason or "unstated"]
    counts["refused_first"] += 1
    if len(attempts) > 1 and attempts[1].honoured_hint and attempts[1].status is not None:
      counts["retried_at_hint"] += 1
      counts["admitted"] += attempts[1].status == 200
  return {reason: dict(c, admitted_fraction=(c["admitted"] / c["retried_at_hint"]
                                             if c["retried_at_hint"] else None))
          for reason, c in sorted(out.items())}


def eta_accuracy(records: Iterable[RequestRecord]) -> dict[str, Any]:
  """Of the admitted requests whose stream said they wait, the share whose first token
  came within `ETA_FACTOR` of the first status's ETA (both from that status)."""
  ratios = []
  for record in records:
    waiting = [(t, eta) for t, state, eta in record.statuses if state == "queueing"]
    if not waiting or not record.chunk_times_s or waiting[0][1] is None:
      continue
    told_at, eta = waiting[0]
    actual = record.chunk_times_s[0] - told_at
    ratios.append(actual / eta if eta > 0 else math.inf)
  within = sum(1 / ETA_FACTOR <= r <= ETA_FACTOR for r in ratios)
  finite = sorted(r for r in ratios if math.isfinite(r))
  return dict(waiting_requests=len(ratios), within=within,
              within_fraction=within / len(ratios) if ratios else None,
              median_actual_over_eta=finite[len(finite) // 2] if finite else None)


# What the server's audit found: its /metrics histograms, before and after a run.
def _metric_families(url: str) -> list[Any]:
  """The server's `/metrics`, parsed."""
  from prometheus_client.parser import text_string_to_metric_families

  with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
    return list(text_string_to_metric_families(response.read().decode()))


def scrape(url: str) -> dict[str, dict[str, float]]:
  """The audit's series, `{reason: {"le=<edge>": cumulative count, "count": n, ...}}`."""
  out: dict[str, dict[str, float]] = collections.defaultdict(dict)
  for family in _metric_families(url):
    if family.name not in ("kvpage:retry_hint_ratio", "kvpage:retry_audit_unresolved"):
      continue
    for sample in family.samples:
      reason = sample.labels.get("reason")
      if reason is None:
        continue
      if sample.name.endswith("_bucket"):
        out[reason][f"le={sample.labels['le']}"] = sample.value
      elif sample.name.endswith("_count"):
        out[reason]["count"] = sample.value
      elif sample.name.endswith("_total"):
        out[reason]["unresolved"] = sample.value
  return dict(out)


def audit_delta(before: Mapping[str, Mapping[str, float]],
                after: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, Any]]:
  """Per reason, the run's audited refusals: how many, the bucket holding the median
  hint / needed, the share at most `RATIO_BAR`, and how many never resolved."""
  out = {}
  for reason, series in sorted(after.items()):
    old = before.get(reason, {})
    delta = {key: value - old.get(key, 0.0) for key, value in series.items()}
    count = delta.get("count", 0.0)
    if not count:
      continue
    edges = sorted((float(key[3:]), value) for key, value in delta.items()
                   if key.startswith("le="))
    low, median = 0.0, None
    for edge, cumulative in edges:
      if cumulative >= count / 2:
        median = f"({low:g}, {edge:g}]"
        break
      low = edge
    at_most = next(value for edge, value in edges if edge == RATIO_BAR)
    out[reason] = dict(audited=int(count), median_ratio_bucket=median,
                       within_bar=int(at_most), within_bar_fraction=at_most / count,
                       unresolved=int(delta.get("unresolved", 0.0)))
  return out


def wait_idle(url: str, timeout_s: float = 600.0) -> None:
  """Until the server runs, queues and holds in line nothing (a run's stragglers gone,
  and every place promised to a refused request returned or lapsed)."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    busy = sum(sample.value for family in _metric_families(url)
               if family.name in ("kvpage:num_requests_running", "kvpage:num_requests_waiting",
                                  "kvpage:num_requests_in_line")
               for sample in family.samples)
    if not busy:
      return
    time.sleep(0.2)
  raise RuntimeError(f"the server at {url} was still busy {timeout_s:.0f} s after a run")


def judge(row: Mapping[str, Any]) -> dict[str, Any]:
  """Each bar of the issue, per reason, from the row's own numbers (None: nothing to
  judge, e.g. no refusal of that reason retried)."""
  first = {reason: None if f["admitted_fraction"] is None
           else f["admitted_fraction"] >= FIRST_RETRY_BAR
           for reason, f in row["first_retries"].items()}
  ratio = {reason: a["within_bar_fraction"] >= 0.5 for reason, a in row["audit"].items()}
  eta = row["eta"]["within_fraction"]
  return dict(first_retry=first, hint_over_needed=ratio,
              eta=None if eta is None else eta >= ETA_BAR)


def load_run(settings: Settings, url: str, vocab_size: int, *, rate: float, seed: int,
             deadline_s: float | None) -> dict[str, Any]:
  """One load of hint-honouring clients; the row of what they saw and what the audit
  found."""
  count = min(settings.max_requests, max(1, round(rate * settings.overload_s)))
  config = LoadConfig(url=url, num_requests=count, request_rate=rate,
                      prompt_len=settings.prompt_len, output_len=settings.output_len,
                      min_token_id=1, max_token_id=vocab_size, ignore_eos=True,
                      temperature=0.0, seed=seed, max_retries=settings.max_retries,
                      timeout_s=settings.timeout_s, include_status=True,
                      max_queue_wait_s=deadline_s)
  before = scrape(url)
  result, reasons = rules.run_load(config)
  wait_idle(url)
  after = scrape(url)
  summary = load_client.summarize(result)
  row = dict(rate_per_s=rate, num_requests=count, seed=seed, deadline_s=deadline_s,
             served=summary["served"], failures=summary["failures"],
             unfinished=summary["unfinished"], rejections=summary["rejections"],
             reasons=reasons,
             retries=summary["retries"], wall_s=result.wall_s,
             first_retries=first_retries(result.requests), audit=audit_delta(before, after),
             eta=eta_accuracy(result.requests))
  row["verdict"] = judge(row)
  return row


def run_benchmark(settings: Settings, config: Any,
                  progress: Callable[[str], None] = print) -> dict[str, Any]:
  """The 1x rate, then each load with plain and deadline clients; the record."""
  server_cores, client_cores = rules.core_split(settings.pin)
  if client_cores is not None:  # the load client (this process) on its own core
    os.sched_setaffinity(0, client_cores)
  flags_ = [f"--config={settings.config_file}", *settings.overrides,
            f"--num_pages={settings.num_pages}",
            f"--config.scheduler.max_waiting={settings.max_waiting}",
            f"--config.server.status_interval_s={settings.status_interval_s}",
            f"--config.server.retry_audit={settings.retry_audit}",
            f"--compilation_cache={settings.compilation_cache}"]
  vocab = config.model.vocab_size
  started_at = time.time()
  # The warm-ups and the 1x run, as overload_http makes them.
  loads = rules.Loads(rules.Settings(
      config_file=settings.config_file, overrides=settings.overrides,
      prompt_len=settings.prompt_len, output_len=settings.output_len,
      at_once_requests=settings.at_once_requests, unloaded_requests=1, overload_s=1.0,
      min_requests=1, max_requests=settings.max_requests, seeds=1, lines=[],
      capacity="at_once", low_load=0.0, timeout_s=settings.timeout_s,
      warmup_requests=WARMUP_REQUESTS), vocab)
  # As many running at once as the pool holds whole: offered everything at once, a
  # server holding no line otherwise admits past its pool and thrashes in preemptions,
  # and its throughput swung 3.5-14 req/s between runs of the same command.
  page_size = config.cache.page_size
  fits = (settings.num_pages - 1) // cdiv(settings.prompt_len + settings.output_len,
                                          page_size)
  no_line = [*flags_, *(f"--config.{key if '.' in key else 'scheduler.' + key}={value}"
                        for key, value in rules.NO_LINE.items())]
  if fits < config.scheduler.max_num_seqs:
    no_line.append(f"--config.scheduler.max_num_seqs={max(1, fits)}")
  at_once: dict[str, Any] | None = None
  if settings.one_x_per_s:  # given: a run repeated at the same rates
    one_x = settings.one_x_per_s
    progress(f"1x: {one_x:.2f} req/s (given)")
  else:
    with rules.started(no_line, server_cores) as server:  # the 1x rate: no line refuses
      loads.warm(server)
      at_once = loads.run(server, rate=math.inf, count=settings.at_once_requests)
    one_x = at_once["served"] / at_once["wall_s"]
    progress(f"1x: {one_x:.2f} req/s ({at_once['served']} of {settings.at_once_requests} "
             f"offered at once to a server holding no line, served in "
             f"{at_once['wall_s']:.2f} s)")
  runs = []
  with rules.started(flags_, server_cores) as server:
    progress(f"server on {server.url}: {server.num_pages:,} KV pages; {server.admission}")
    loads.warm(server)
    wait_idle(server.url)
    for load in settings.loads:
      kinds = [None, settings.deadline_s] if settings.deadline_s else [None]
      for seed, deadline in enumerate(kinds):
        row = load_run(settings, server.url, vocab, rate=load * one_x, seed=seed,
                          deadline_s=deadline)
        row["load"] = load
        runs.append(row)
        progress(table_rows([row]))
    server_models = asyncio.run(rules._models(server.url))
    admission = server.admission
  return dict(
      benchmark="retry_http", smoke=settings.smoke,
      measured=dict(one_x_per_s=one_x, one_x_given=bool(settings.one_x_per_s),
                    at_once=at_once), runs=runs,
      bars=dict(first_retry_admission=FIRST_RETRY_BAR, median_hint_over_needed=RATIO_BAR,
                eta_factor=ETA_FACTOR, eta_share=ETA_BAR),
      premises=dict(
          config=settings.config_file, overrides=list(settings.overrides),
          model=config.model.to_dict(), dtype=config.model.dtype,
          kv_dtype=config.cache.kv_dtype, page_size=config.cache.page_size,
          num_pages=settings.num_pages, server_flags=flags_, server_admission=admission,
          prompt_len=settings.prompt_len, output_len=settings.output_len, ignore_eos=True,
          temperature=0.0, arrival_process="poisson", settings=dataclasses.asdict(settings),
          scheduler=config.scheduler.to_dict(), server=config.server.to_dict(),
          server_models=server_models, server_cores=sorted(server_cores or []),
          client_cores=sorted(client_cores or []), wall_s=time.time() - started_at,
          **premises.environment()))


def _share(value: float | None) -> str:
  return "n/a" if value is None else f"{value:.0%}"


def table_rows(runs: Sequence[Mapping[str, Any]]) -> str:
  lines = []
  for row in runs:
    kind = f"deadline {row['deadline_s']:g} s" if row["deadline_s"] else "plain"
    lines.append(f"{row['load']:g}x ({row['rate_per_s']:.1f} req/s), {kind} clients: "
                 f"{row['served']} of {row['num_requests']} served, refusals "
                 f"{row['reasons'] or 'none'}, {row['retries']} retries; ETA within "
                 f"{ETA_FACTOR:g}x for {_share(row['eta']['within_fraction'])} of "
                 f"{row['eta']['waiting_requests']} waiting requests")
    for reason in sorted(set(row["first_retries"]) | set(row["audit"])):
      first = row["first_retries"].get(reason, {})
      audit = row["audit"].get(reason, {})
      lines.append(
          f"  {reason:<14} first retry admitted {_share(first.get('admitted_fraction'))} "
          f"({first.get('admitted', 0)} of {first.get('retried_at_hint', 0)}); hint/needed "
          f"median in {audit.get('median_ratio_bucket', 'n/a')}, <= {RATIO_BAR:g} for "
          f"{_share(audit.get('within_bar_fraction'))} of {audit.get('audited', 0)} audited, "
          f"{audit.get('unresolved', 0)} unresolved")
  return "\n".join(lines)


