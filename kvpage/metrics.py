"""Serving metrics: per request, per step, and a summary that carries its premises.

Pressure on a server comes from long inputs, long outputs or the scheduling policy,
and each leaves a different trace. Per request: queue wait (arrival to first
scheduled), time to first token (TTFT), time per output token after the first
(TPOT), inter-token latencies and end-to-end latency. Per step: running, waiting and
swapped requests, KV usage, prompt and generated tokens batched, preemptions by mode
and rejections by status. The summary gives p50/p90/p99, prompt and generated
tokens/s, the time-weighted running batch size (vLLM, SOSP'23) and goodput under an
optional TTFT/TPOT SLO (DistServe, OSDI'24), counted in requests and weighted by prompt
tokens, overall and per prompt-length class: a line that refuses the long prompts to
serve many short ones scores well in requests and badly in tokens.

`MetricsRecorder.on_step` plugs into `Engine(on_step=...)`; it reads the scheduler's
counters and the clock, never the device. Written as JSONL time series plus one
summary JSON with the premises (model, dtype, lengths, policies, hardware, versions).
"""

import collections
import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvpage.interface import CostTraits
from kvpage.request import Request, RequestStatus


def longest_decode(sequences: Sequence[tuple[int, int]]) -> int:
  """The longest context among a step's decodes (0 if it has none), from `(new tokens,
  context)` per sequence."""
  return max((c for n, c in sequences if n == 1), default=0)


def step_counts(sequences: Sequence[tuple[int, int]],
                num_sampled: int | None = None) -> dict[str, int]:
  """The counts a step's cost depends on, from `(new tokens, context)` per sequence:
  tokens, sequences, LM-head rows, prefill attention pairs (query i of n new tokens in
  a context of c sees c - n + i + 1 keys) and decode context tokens."""
  return dict(num_tokens=sum(n for n, _ in sequences), num_sequences=len(sequences),
              num_sampled=len(sequences) if num_sampled is None else num_sampled,
              prefill_pairs=sum(n * (c - n) + n * (n + 1) // 2 for n, c in sequences if n > 1),
              decode_context=sum(c for n, c in sequences if n == 1))


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
  """p50/p90/p99/mean/max of `values` (None for an empty list)."""
  if not len(values):
    return dict(p50=None, p90=None, p99=None, mean=None, max=None)
  array = np.asarray(values, np.float64)
  p50, p90, p99 = np.percentile(array, [50, 90, 99])
  return dict(p50=float(p50), p90=float(p90), p99=float(p99), mean=float(array.mean()),
              max=float(array.max()))


# The prompt-length classes of the summary's `by_prompt_length`: (name, the most prompt
# tokens it holds, a name fit for a column).
PROMPT_CLASSES = (("<=256", 256, "upto256"), ("257-1024", 1024, "257to1024"),
                  ("1025-4096", 4096, "1025to4096"), (">4096", float("inf"), "over4096"))
PROMPT_CLASS_KEYS = {name: key for name, _, key in PROMPT_CLASSES}


def prompt_class(tokens: int) -> str:
  """The name of the prompt-length class `tokens` falls in ("<=256", ..., ">4096")."""
  return next(name for name, most, _ in PROMPT_CLASSES if tokens <= most)


def running_batch(steps: Sequence[dict[str, Any]]) -> dict[str, float | None]:
  """The running batch size over a run: the time-weighted mean, p50 and p99 of the number
  of sequences in the batch, the figure the vLLM paper (SOSP'23, Fig. 13) compares
  systems by. None each for a run without steps or without time between them (as
  `percentiles` has for an empty list).

  The count is a step row's `num_seqs`: the sequences batched in the step that ran until
  the row's `time` (the step's `len(scheduled)`: decodes and prefill chunks alike). Not
  `num_running`, the scheduler's `len(running)`: a gauge read when the step's samples
  are applied, so it has already dropped the sequences that finished in that step and,
  under async scheduling, describes the running queue after the next step was
  scheduled; and it counts running requests the step did not compute (decodes stalled
  behind a prefill-first step, sequences past the token budget).

  The step function holds each row's count from the previous row's `time` (the run's
  start, 0, for the first) to its own, so each count weighs the time its step lasted.
  One exception: when the server sat idle before a step (the previous row left nothing
  running, waiting or swapped, or the run had just started) and the row has its step's
  seconds (`step_s`), the gap before the step was launched counts as an empty batch,
  not as the step's, so that a lightly loaded run is not credited its batches for its
  idle time. The span ends at the last row (what follows it is the drained server).
  Percentiles are of that step function over time: p50 is the smallest count the batch
  was at or below for at least half the time.
  """
  counts: list[float] = []
  weights: list[float] = []
  previous, idle = 0.0, True
  for row in steps:
    interval = max(0.0, row["time"] - previous)
    if idle and row.get("step_s") is not None:
      busy = min(interval, max(0.0, row["step_s"]))
      counts.append(0.0)
      weights.append(interval - busy)
      interval = busy
    counts.append(float(row["num_seqs"]))
    weights.append(interval)
    previous = row["time"]
    idle = all(row.get(key, 1) == 0 for key in ("num_running", "num_waiting", "num_swapped"))
  values, time = np.asarray(counts, np.float64), np.asarray(weights, np.float64)
  kept = time > 0
  values, time = values[kept], time[kept]
  if not len(values):
    return dict(mean=None, p50=None, p99=None)
  order = np.argsort(values, kind="stable")
  values, cumulative = values[order], np.cumsum(time[order])
  total = cumulative[-1]

  def percentile(q: float) -> float:
    # The first count whose cumulative time reaches q% (a hair under: rounding).
    index = np.searchsorted(cumulative, q / 100 * total * (1 - 1e-9), side="left")
    return float(values[min(index, len(values) - 1)])

  return dict(mean=float(np.dot(values, time[order]) / total), p50=percentile(50),
              p99=percentile(99))


def _first_event(request: Request, kind: str) -> float | None:
  return next((event.time for event in request.events if event.kind == kind), None)


MAX_FAILED_LISTED = 100


def step_work(output: Any, last_step_time: tuple[int, float] | None,
              shape: tuple[int, int] | None = None,
              decode_reads_longest: bool = False) -> dict[str, Any]:
  """A step's measured seconds (`step_s`: launch to samples back, None if unpriced) and
  the counts its cost depends on (`work`, `step_counts` per
  iteration, with the `(tokens, sequences)` it was padded to when `shape` is given),
  for `experiments/calibrate.py`."""
  scheduled = output.scheduled
  sequences = [(len(seq.token_ids), seq.start_position + len(seq.token_ids))
               for seq in scheduled]
  work = step_counts(sequences, sum(seq.samples for seq in scheduled))
  work.update(iterations=max((seq.num_steps for seq in scheduled), default=1),
              swap_pages=len(output.swap_out) + len(output.swap_in))
  if decode_reads_longest:  # what each padded row's decode attention reads
    work.update(decode_longest=longest_decode(sequences))
  if shape is not None:
    work.update(padded_tokens=shape[0], padded_sequences=shape[1])
  seconds = (last_step_time[1] if last_step_time is not None
             and last_step_time[0] == output.step else None)
  return dict(step_s=seconds, work=work)


def failed_requests(rows: Sequence[dict[str, Any]],
                    limit: int = MAX_FAILED_LISTED) -> dict[str, Any]:
  """The requests that did not finish normally: counts by reason, and the first `limit`.

  A figure drawn only from the requests that finished says nothing of those that did
  not; listing them (bounded, so a run of a million rejections stays readable) lets
  a reader see what failed and why without opening `requests.jsonl`.
  """
  failed = []
  for row in rows:
    if row["status"] == RequestStatus.REJECTED.value:
      reason = f"rejected {row['rejected_status']}"
    elif row["status"] == RequestStatus.FINISHED.value and row["finish_reason"] in (
        "length", "stop"):
      continue
    elif row["status"] == RequestStatus.FINISHED.value:
      reason = str(row["finish_reason"])
    else:  # still waiting, running or swapped when the run ended
      reason = f"unfinished ({row['status']})"
    failed.append(dict(request_id=row["request_id"], reason=reason,
                       detail=row.get("reject_reason")))
  return dict(num_failed=len(failed),
              by_reason=dict(collections.Counter(item["reason"] for item in failed)),
              first=failed[:limit])


class MetricsRecorder:
  """Collects step rows and token timestamps while an engine runs.

  With `history` off (a server that runs for days) it keeps nothing of a request after
  `finish` hands back its row, and no step rows: `on_step` returns each one instead.
  """

  def __init__(self, scheduler: Any, clock: Callable[[], float], *, history: bool = True,
               step_shape: Callable[[Any], tuple[int, int]] | None = None,
               traits: CostTraits | None = None,
               step_parts: Callable[[int], dict[str, float] | None] | None = None):
    self.scheduler = scheduler
    self.clock = clock
    self.step_shape = step_shape  # the executor's: each step's padded shape, recorded
    self.traits = traits or CostTraits()  # the executor's: what its decode rows read, recorded
    self.step_parts = step_parts  # the executor's: a priced step's parts, recorded
    self.history = history
    self.requests: list[Request] = []
    self.steps: list[dict[str, Any]] = []
    self.token_times: dict[str, list[float]] = collections.defaultdict(list)
    self._last: dict[str, Any] = dict(preemptions={}, rejections={}, prefix_query_tokens=0,
                                      prefix_hit_tokens=0)
    self.start_time = clock()

  def track(self, request: Request) -> None:
    """Registers a submitted request (admitted or not)."""
    if self.history:
      self.requests.append(request)

  def finish(self, request: Request) -> dict[str, Any]:
    """The row of a request that ended; without `history`, forgets its token times."""
    row = self.request_row(request)
    if not self.history:
      self.token_times.pop(request.request_id, None)
    return row

  def on_step(self, output: Any, new_tokens: dict[str, list[int]],
              finished: list[Request]) -> dict[str, Any]:
    """Records one step; returns its row (kept in `steps` with `history`)."""
    del finished  # Read from the requests themselves.
    now = self.clock()
    stats = self.scheduler.stats()
    row = dict(step=output.step, time=now - self.start_time,
               num_running=stats["num_running"], num_waiting=stats["num_waiting"],
               num_swapped=stats["num_swapped"], kv_usage=stats["kv_usage"],
               num_free_pages=stats["num_free_pages"],
               prompt_tokens=output.num_prefill_tokens,
               generated_tokens=sum(map(len, new_tokens.values())),
               num_seqs=len(output.scheduled), swap_pages=len(output.swap_out) + len(
                   output.swap_in))
    row.update(step_work(output, getattr(self.scheduler, "last_step_time", None),
                         self.step_shape(output) if self.step_shape else None,
                         self.traits.decode_reads_longest))
    parts = self.step_parts(output.step) if self.step_parts else None
    if parts is not None:  # a simulated step: what each part of its price was
      row["parts"] = parts
    for key in ("preemptions", "rejections"):
      row[key] = {str(k): v - self._last[key].get(k, 0) for k, v in stats[key].items()}
      self._last[key] = dict(stats[key])
    if stats["prefix_caching"]:  # this step's lookups, and the cache's pages after it
      for key in ("prefix_query_tokens", "prefix_hit_tokens"):
        row[key] = stats[key] - self._last[key]
        self._last[key] = stats[key]
      row.update(num_cached_pages=stats["num_cached_pages"],
                 num_evictable_pages=stats["num_evictable_pages"])
    if self.history:
      self.steps.append(row)
    for request_id, tokens in new_tokens.items():  # a multi-step decode's arrive together
      self.token_times[request_id].extend([now] * len(tokens))
    return row

  def request_rows(self) -> list[dict[str, Any]]:
    """Per-request latencies (seconds) and outcome, for every tracked request."""
    return [self.request_row(request) for request in self.requests]

  def request_row(self, request: Request) -> dict[str, Any]:
    """One request's latencies (seconds) and outcome: the one definition of each figure."""
    arrival = request.arrival_time
    scheduled, first = _first_event(request, "scheduled"), _first_event(request, "first_token")
    done = _first_event(request, "finished") if request.is_finished else None
    times = self.token_times.get(request.request_id, [])
    gaps = np.diff(times).tolist() if len(times) > 1 else []
    rejection = next((e.detail for e in request.events if e.kind == "rejected"), {})
    tpot = ((done - first) / (request.num_output_tokens - 1)
            if done is not None and first is not None and request.num_output_tokens > 1
            else None)
    return dict(
        request_id=request.request_id, priority=request.priority,
        prompt_tokens=request.num_prompt_tokens, output_tokens=request.num_output_tokens,
        status=request.status.value, finish_reason=request.finish_reason,
        rejected_status=rejection.get("status"), reject_reason=rejection.get("reason"),
        arrival=arrival - self.start_time,
        queue_wait_s=None if scheduled is None else scheduled - arrival,
        ttft_s=None if first is None else first - arrival, tpot_s=tpot,
        e2e_s=None if done is None else done - arrival, itl_s=gaps,
        num_preemptions=request.num_preemptions)

  def summary(self, premises: dict[str, Any], slo_ttft_s: float | None = None,
              slo_tpot_s: float | None = None) -> dict[str, Any]:
    """The summary record: counts, latency percentiles, throughput, goodput, the running
    batch (`running_batch`), premises."""
    rows = self.request_rows()
    stats = self.scheduler.stats()
    end = self.clock() - self.start_time
    rejections = {str(k): v for k, v in stats["rejections"].items()}
    computed = sum(s["prompt_tokens"] for s in self.steps)
    hits = stats.get("prefix_hit_tokens", 0)
    return dict(
        num_requests=len(rows), num_admitted=stats["num_admitted"],
        rejections=rejections, num_rejected=sum(rejections.values()),
        num_preemptions=stats["num_preemptions"],
        preemptions={str(k): v for k, v in stats["preemptions"].items()},
        max_kv_usage=max((s["kv_usage"] for s in self.steps), default=0.0),
        pages_total=stats["num_usable_pages"], pages_free_at_end=stats["num_free_pages"],
        num_steps=len(self.steps), duration_s=end, running_batch=running_batch(self.steps),
        prefill_tokens_computed=computed,
        # Prefill computed again after recompute preemptions: beyond each scheduled
        # request's prompt (computed once, or found in the prefix cache), what was thrown
        # away and redone.
        recomputed_tokens=max(0, computed + hits - sum(r["prompt_tokens"] for r in rows
                                                       if r["queue_wait_s"] is not None)),
        prefix_cache=_prefix_summary(stats),
        **request_summary(rows, end, slo_ttft_s, slo_tpot_s), premises=premises)

  def files(self, summary: dict[str, Any]) -> dict[str, str]:
    """`steps.jsonl`, `requests.jsonl` and `summary.json`, by name, as text."""
    return {"steps.jsonl": "".join(json.dumps(row) + "\n" for row in self.steps),
            "requests.jsonl": "".join(json.dumps(row) + "\n" for row in self.request_rows()),
            "summary.json": json.dumps(summary, indent=2)}

  def write(self, workdir: str | pathlib.Path, summary: dict[str, Any]) -> None:
    """`files(summary)` under `workdir`."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for name, text in self.files(summary).items():
      (workdir / name).write_text(text)


def request_summary(rows: Sequence[dict[str, Any]], duration_s: float,
                    slo_ttft_s: float | None = None,
                    slo_tpot_s: float | None = None) -> dict[str, Any]:
  """What the request rows (`MetricsRecorder.request_row`) of a run of `duration_s` say:
  finished and aborted counts, latency percentiles of the finished, throughput, goodput
  under the SLOs (a finished request within both; the rest count against it), by prompt
  length, and the running requests that failed. One engine's summary and a fleet's
  share it."""
  done = [r for r in rows if r["status"] == RequestStatus.FINISHED.value
          and r["finish_reason"] in ("length", "stop")]
  duration = max(duration_s, 1e-9)
  good = [r for r in done if (slo_ttft_s is None or r["ttft_s"] <= slo_ttft_s)
          and (slo_tpot_s is None or r["tpot_s"] is None or r["tpot_s"] <= slo_tpot_s)]
  offered_tokens = sum(r["prompt_tokens"] for r in rows)
  return dict(
      num_finished=len(done),
      num_aborted=sum(r["finish_reason"] in ("aborted", "preempted") for r in rows),
      queue_wait_s=percentiles([r["queue_wait_s"] for r in done]),
      ttft_s=percentiles([r["ttft_s"] for r in done]),
      tpot_s=percentiles([r["tpot_s"] for r in done if r["tpot_s"] is not None]),
      itl_s=percentiles([gap for r in done for gap in r["itl_s"]]),
      e2e_s=percentiles([r["e2e_s"] for r in done]),
      prompt_tokens_per_s=sum(r["prompt_tokens"] for r in done) / duration,
      output_tokens_per_s=sum(r["output_tokens"] for r in done) / duration,
      slo=dict(ttft_s=slo_ttft_s, tpot_s=slo_tpot_s),
      goodput_requests_per_s=len(good) / duration,
      goodput_fraction=len(good) / len(rows) if rows else 0.0,
      goodput_token_fraction=(sum(r["prompt_tokens"] for r in good) / offered_tokens
                              if offered_tokens else 0.0),
      by_prompt_length=by_prompt_length(rows, done, good),
      failed_requests=failed_requests(rows))


def by_prompt_length(rows: Sequence[dict[str, Any]], done: Sequence[dict[str, Any]],
                     good: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Per prompt-length class (`PROMPT_CLASSES`) with requests: how many were offered,
  finished (`done`), rejected and within both SLOs (`good`), and that share of the
  offered."""
  out: dict[str, dict[str, Any]] = {}
  done_ids, good_ids = {r["request_id"] for r in done}, {r["request_id"] for r in good}
  for row in sorted(rows, key=lambda r: r["prompt_tokens"]):
    entry = out.setdefault(prompt_class(row["prompt_tokens"]),
                           dict(offered=0, finished=0, rejected=0, good=0))
    entry["offered"] += 1
    entry["finished"] += row["request_id"] in done_ids
    entry["rejected"] += row["status"] == RequestStatus.REJECTED.value
    entry["good"] += row["request_id"] in good_ids
  for entry in out.values():
    entry["good_fraction"] = entry["good"] / entry["offered"]
  return out


def _prefix_summary(stats: dict[str, Any]) -> dict[str, Any]:
  """The prefix cache's counters at the end of a run (`enabled` false: it was off)."""
  if not stats.get("prefix_caching"):
    return dict(enabled=False)
  return dict(enabled=True, query_tokens=stats["prefix_query_tokens"],
              hit_tokens=stats["prefix_hit_tokens"], hit_rate=stats["prefix_hit_rate"],
              evicted_pages=stats["prefix_evicted_pages"],
              cached_pages_at_end=stats["num_cached_pages"])
