"""`/metrics`: the server's figures in Prometheus text, named like vLLM's (`kvpage:`).

Every per-request figure comes from `kvpage.metrics.MetricsRecorder`, the recorder
`serve_bench` uses, so a TTFT here and a TTFT in a serve_bench summary are the same
definition (arrival at the scheduler to the step that sampled the first token). The
recorder runs without history: a request's row is read once, when it ends, and
forgotten. Gauges are set after every step from the scheduler's own counters.

Counted as a rejection (`request_rejections_total{code}`): every request answered with
an error status before its response started — the scheduler's 400/429/503 and the
gateway's own (malformed bodies, unknown models, draining).

Whether the retry hints told the truth (`kvpage.host.retry_audit`, on when the
scheduler's `retry_audit` is): per rejection reason, `retry_hint_ratio` is the hint over
the wait the refused request really needed (under 1: early, a client that honours it is
refused again; over 1: late), `retry_needed_seconds` that wait, and
`retry_audit_unresolved_total` the refusals still refused at the end of their watch.

Dashboards built for vLLM read the same figures under vLLM's names: `vllm:` twins of
the series vLLM exports, with vLLM's labels: an `engine` label ("0"),
`finished_reason` for `finish_reason`, and preemptions summed over their modes. Every
series, kvpage's and the twins, exists at zero from start-up for each label value it
can take (finish reasons, preemption modes, the common rejection statuses and retry
reasons), as vLLM's do: a rate over a series that appears only at its first event
reads nothing for that event.
"""

from collections.abc import Callable
from typing import Any

import prometheus_client as prom

from kvpage.metrics import MetricsRecorder
from kvpage.request import Request

# Latency buckets (seconds), vLLM's ranges: TTFT and queue time from 1 ms, token gaps
# from 10 ms, end to end from 0.3 s.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
# hint / needed: 1 is exact; the 2 bucket's edge is the bound a hint is judged by.
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)

# The scheduler's finish reasons as a client sees them (OpenAI's three).
FINISH_REASONS = {"length": "length", "stop": "stop", "aborted": "abort", "preempted": "abort",
                  "deadline": "abort"}
# Label values present from start-up (others appear when they first happen).
PREEMPTION_MODES = ("recompute", "swap", "abort")
REJECTION_STATUSES = ("400", "429", "503")
RETRY_REASONS = ("kv_pressure", "queue_full", "wait_forecast", "wait_deadline",
                 "concurrency_limit", "token_budget")
VLLM_ENGINE = "0"  # the `engine` label of one engine core


class ServerMetrics:
  """A private Prometheus registry fed by the engine thread and the HTTP layer."""

  def __init__(self, scheduler: Any, clock: Callable[[], float], model_name: str):
    self.scheduler = scheduler
    self.recorder = MetricsRecorder(scheduler, clock, history=False)
    prom.disable_created_metrics()  # no `_created` twin of every series (vLLM's choice too)
    self.registry = prom.CollectorRegistry()
    labels = ("model_name",)
    self._model = model_name

    def gauge(name: str, doc: str) -> prom.Gauge:
      return prom.Gauge(f"kvpage:{name}", doc, labels, registry=self.registry)

    def counter(name: str, doc: str, *extra: str) -> prom.Counter:
      return prom.Counter(f"kvpage:{name}", doc, (*labels, *extra), registry=self.registry)

    def histogram(name: str, doc: str, buckets: tuple[float, ...],
                  *extra: str) -> prom.Histogram:
      return prom.Histogram(f"kvpage:{name}", doc, (*labels, *extra), buckets=buckets,
                            registry=self.registry)

    self.running = gauge("num_requests_running", "Requests holding device pages.")
    self.waiting = gauge("num_requests_waiting", "Admitted requests waiting for a step.")
    self.swapped = gauge("num_requests_swapped", "Requests swapped out to host pages.")
    self.in_line = gauge("num_requests_in_line", "Refused requests whose place in line is "
                         "held until they return (retry reservations).")
    self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of usable KV pages in use (0-1).")
    self.cached_pages = gauge("prefix_cache_pages", "KV pages named by the prefix cache.")
    self.evictable_pages = gauge("prefix_cache_evictable_pages",
                                 "Named KV pages no request holds: reusable, or evicted "
                                 "for new tokens.")
    self.prefix_queries = counter("prefix_cache_queries_total",
                                  "Tokens looked up in the prefix cache (vLLM's name).")
    self.prefix_hits = counter("prefix_cache_hits_total",
                               "Of them, tokens found cached (their pages reused).")
    self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of ended requests.")
    self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
    self.rejections = counter("request_rejections_total",
                              "Requests answered with an error status before they started.",
                              "code")
    self.preemptions = counter("num_preemptions_total", "Preemptions, by mode.", "mode")
    self.successes = counter("request_success_total", "Ended requests, by finish reason.",
                             "finish_reason")
    self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.",
                          TTFT_BUCKETS)
    self.itl = histogram("inter_token_latency_seconds", "Gap between output tokens.",
                         ITL_BUCKETS)
    self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the end.", E2E_BUCKETS)
    self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                TTFT_BUCKETS)
    self.hint_ratio = histogram("retry_hint_ratio", "A refusal's retry hint over the wait "
                                "it really needed (audited), by reason.", RATIO_BUCKETS,
                                "reason")
    self.hint_needed = histogram("retry_needed_seconds", "The wait an audited refusal "
                                 "really needed before a retry would be admitted.",
                                 TTFT_BUCKETS, "reason")
    self.hint_unresolved = counter("retry_audit_unresolved_total", "Audited refusals "
                                   "still refused at the end of their watch.", "reason")
    self.in_line.labels(self._model).set_function(self._num_in_line)  # read when scraped
    self._at_zero()
    # The series vLLM exports too, twinned under `vllm:` with vLLM's labels.
    self.registry.register(_VllmTwins([
        self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
        self.prompt_tokens, self.generation_tokens, self.preemptions, self.successes,
        self.ttft, self.itl, self.e2e, self.queue_time]))
    self.set_gauges()

  def _at_zero(self) -> None:
    """Every series with each label value it can take, at zero (see the module doc)."""
    model = self._model
    for metric in (self.running, self.waiting, self.swapped, self.kv_usage, self.cached_pages,
                   self.evictable_pages, self.prefix_queries, self.prefix_hits,
                   self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                   self.queue_time):
      metric.labels(model)
    for reason in dict.fromkeys(FINISH_REASONS.values()):
      self.successes.labels(model, reason)
    for mode in PREEMPTION_MODES:
      self.preemptions.labels(model, mode)
    for status in REJECTION_STATUSES:
      self.rejections.labels(model, status)
    for reason in RETRY_REASONS:
      for metric in (self.hint_ratio, self.hint_needed, self.hint_unresolved):
        metric.labels(model, reason)

  def set_gauges(self) -> None:
    stats = self.scheduler.stats()
    self.running.labels(self._model).set(stats["num_running"])
    self.waiting.labels(self._model).set(stats["num_waiting"])
    self.swapped.labels(self._model).set(stats["num_swapped"])
    self.kv_usage.labels(self._model).set(stats["kv_usage"])
    self.cached_pages.labels(self._model).set(stats["num_cached_pages"])
    self.evictable_pages.labels(self._model).set(stats["num_evictable_pages"])

  def _num_in_line(self) -> int:
    """Places held for refused requests, not yet lapsed (read when scraped)."""
    return self.scheduler.admission.wait.num_held(self.scheduler.clock())

  # Fed by the engine thread.
  def on_step(self, output: Any, new_tokens: dict[str, list[int]],
              finished: list[Request]) -> None:
    """`Engine(on_step=...)`: token and preemption counts, then the gauges."""
    row = self.recorder.on_step(output, new_tokens, finished)
    if row["generated_tokens"]:
      self.generation_tokens.labels(self._model).inc(row["generated_tokens"])
    for mode, count in row["preemptions"].items():
      if count:
        self.preemptions.labels(self._model, mode).inc(count)
    self.prefix_queries.labels(self._model).inc(row.get("prefix_query_tokens", 0))
    self.prefix_hits.labels(self._model).inc(row.get("prefix_hit_tokens", 0))
    audit = self.scheduler.audit
    for verdict in audit.take() if audit is not None else ():
      self.hint_ratio.labels(self._model, verdict.reason).observe(verdict.ratio)
      if verdict.needed_s is None:
        self.hint_unresolved.labels(self._model, verdict.reason).inc()
      else:
        self.hint_needed.labels(self._model, verdict.reason).observe(verdict.needed_s)
    self.set_gauges()

  def ended(self, request: Request) -> None:
    """A request ended (any reason): its latencies, from the recorder's row."""
    row = self.recorder.finish(request)
    model = self._model
    self.prompt_tokens.labels(model).inc(row["prompt_tokens"])
    reason = FINISH_REASONS.get(str(row["finish_reason"]), "abort")
    self.successes.labels(model, reason).inc()
    for name, histogram in (("ttft_s", self.ttft), ("queue_wait_s", self.queue_time),
                            ("e2e_s", self.e2e)):
      if row[name] is not None:
        histogram.labels(model).observe(row[name])
    for gap in row["itl_s"]:
      self.itl.labels(model).observe(gap)

  # Fed by either side.
  def rejected(self, status: int) -> None:
    self.rejections.labels(self._model, str(status)).inc()

  def render(self) -> bytes:
    """The Prometheus text exposition of every figure."""
    return prom.generate_latest(self.registry)


class _VllmTwins(prom.registry.Collector):
  """At each scrape, the series of `metrics` again under `vllm:`, labelled as vLLM labels
  them (see the module doc)."""

  def __init__(self, metrics: list[Any]):
    self.metrics = metrics

  def collect(self) -> Any:
    for family in (family for metric in self.metrics for family in metric.collect()):
      twin = prom.Metric(family.name.replace("kvpage:", "vllm:", 1), family.documentation,
                         family.type)
      values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
      for sample in family.samples:
        labels = {"finished_reason" if key == "finish_reason" else key: value
                  for key, value in sample.labels.items() if key != "mode"}
        labels["engine"] = VLLM_ENGINE
        key = (sample.name.replace("kvpage:", "vllm:", 1), tuple(sorted(labels.items())))
        values[key] = values.get(key, 0.0) + sample.value
      for (name, labels), value in values.items():
        twin.add_sample(name, dict(labels), value)
      yield twin
