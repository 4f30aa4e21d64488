"""The `scheduler` config section: every policy knob of `kvpage.host.scheduler`, with defaults.

Defaults follow vLLM where it has an equivalent (`max_num_seqs` 256, chunked prefill
on, recompute preemption) and the mission for admission (a 15% free-page
watermark). They are templates to be re-decided from measurements, not truths;
`kvpage.host.scheduler_config.check` (which the `Scheduler` calls) rejects values outside
the choices.
"""

import ml_collections


def get_scheduler_config() -> ml_collections.ConfigDict:
  """Defaults for continuous batching, admission, chunked prefill and preemption."""
  return ml_collections.ConfigDict(dict(
      # Continuous batching (Orca, OSDI'22): the running set and one step's work.
      max_num_seqs=256,  # requests in the running set at once
      max_num_batched_tokens=2048,  # tokens computed in one step (prefill + decode)
      # Admission at arrival: bounded queue, token-based page estimate, watermark.
      # watermark: 503 under cache pressure, 429 when the queue is full (kvpage's);
      # queue_only: only the queue bound answers (vLLM's behaviour).
      admission="watermark",
      max_waiting=1024,  # admitted-but-not-running requests; beyond: 429; 0 = unbounded
      watermark=0.15,  # fraction of usable pages that must stay free after admission; else 503
      # The other lines an operator may hold, each off at 0; any may join the KV line
      # (the line study, experiments/line_study.py, sets them against each other):
      rate_limit=0.0,  # requests/s through a token bucket (a gateway's rate limit); 429
      rate_burst=1,  # the bucket's size: requests that may pass at once
      max_concurrent=0,  # admitted, unfinished requests (TGI's max_concurrent_requests); 429
      max_inflight_tokens=0,  # prompt + expected output tokens of admitted, unfinished
      # requests, this one's included; beyond: 503
      # The forecast-TTFT lines (429): refuse a request whose first token the wait
      # forecast puts later than max_forecast_ttft_s seconds after its arrival, or later
      # than max_ttft_slowdown times its time to first token on an idle engine (its
      # prompt's prefill steps alone). A request's own max_queue_wait_s, which also
      # expires it while it waits, takes precedence over both.
      max_forecast_ttft_s=0.0,
      max_ttft_slowdown=0.0,
      output_estimate="max_tokens",  # expected output tokens: max_tokens | fixed | running_mean
      fixed_output_estimate=256,  # used by output_estimate="fixed"
      output_estimate_window=1000,  # finished requests averaged by "running_mean"
      # Retry hints and ETAs come from a forecast of the scheduler, its steps priced by a
      # model fit to the last step_cost_window prefill and decode steps each.
      step_cost_window=64,
      default_retry_after_s=1.0,  # retry_after before any step was priced
      max_retry_after_s=60.0,
      # Stretch each retry hint by a seeded factor in [1, 1 + retry_jitter) so clients
      # told the same moment spread out; 0 = exact hints.
      retry_jitter=0.0,
      retry_jitter_seed=0,
      # Hold room for a 503'd request until it retries with the same id (or lapses
      # retry_grace_s after its hint): newcomers see that room as taken, so a client
      # that returns when told finds its pages. Changes who is admitted; off = the
      # line of rejected requests shapes hints only.
      retry_reservations=False,
      retry_grace_s=2.0,
      # Audit the hints: watch up to this many refused requests at once, checking at each
      # step's end whether a retry would now be admitted (kvpage.host.retry_audit; what
      # /metrics reports as hint / needed). 0 = off; `serve` turns it on.
      retry_audit=0,
      # Chunked prefill (Sarathi-Serve, OSDI'24): none = whole prompts, prefill-first;
      # chunked = decode-first, prefill chunks fill the rest of the token budget.
      prefill_policy="chunked",
      chunk_size=512,  # most prompt tokens of one request per step; 0 = only the budget caps
      # Preemption when a running request needs a page and none is free.
      preemption_mode="recompute",  # recompute | swap | abort
      num_host_pages=0,  # host swap pool; Scheduler(num_host_pages=...) overrides it
      # Async scheduling (vLLM's --async-scheduling): schedule and launch step N+1 while
      # step N runs, so host work hides behind the device. The simulator honours it too:
      # its device queues each launched step behind the one in flight, so a request
      # arriving during step N joins step N+2 there as on a real device.
      async_scheduling=True,
      # Multi-step decoding (vLLM's multi-step scheduling, --num-scheduler-steps): when a
      # step is all decodes and nothing waits to join, run this many decode iterations
      # in one device launch, feeding each sample to the next on the device. Host work
      # and launch cost are paid once per launch; a request arriving meanwhile waits up
      # to that many iterations to join, and a stop token is seen only at the end.
      num_decode_steps=1,
  ))
