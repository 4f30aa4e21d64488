"""The `scheduler` config section: every policy knob of `kvpage.scheduler`, with defaults.

Defaults follow vLLM where it has an equivalent (`max_num_seqs` 256, chunked prefill
on, recompute preemption) and the mission for admission (a 15% free-page
watermark). They are templates to be re-decided from measurements, not truths;
`check` (which `kvpage.scheduler.Scheduler` calls) rejects values outside the choices.
"""

import ml_collections

OUTPUT_ESTIMATES = ("max_tokens", "fixed", "running_mean")
PREFILL_POLICIES = ("none", "chunked")
PREEMPTION_MODES = ("recompute", "swap", "abort")
MAX_DECODE_STEPS = 256  # a launch returns [num_decode_steps, rows] samples


def get_scheduler_config() -> ml_collections.ConfigDict:
  """Defaults for continuous batching, admission, chunked prefill and preemption."""
  return ml_collections.ConfigDict(dict(
      # Continuous batching (Orca, OSDI'22): the running set and one step's work.
      max_num_seqs=256,  # requests in the running set at once
      max_num_batched_tokens=2048,  # tokens computed in one step (prefill + decode)
      # Admission at arrival: bounded queue, token-based page estimate, watermark.
      max_waiting=1024,  # admitted-but-not-running requests; beyond: 429
      watermark=0.15,  # fraction of usable pages that must stay free after admission; else 503
      output_estimate="max_tokens",  # expected output tokens: max_tokens | fixed | running_mean
      fixed_output_estimate=256,  # used by output_estimate="fixed"
      output_estimate_window=1000,  # finished requests averaged by "running_mean"
      retry_after_window_s=10.0,  # page frees this recent set the retry_after rate
      default_retry_after_s=1.0,  # retry_after when no page has been freed recently
      max_retry_after_s=60.0,
      # Chunked prefill (Sarathi-Serve, OSDI'24): none = whole prompts, prefill-first;
      # chunked = decode-first, prefill chunks fill the rest of the token budget.
      prefill_policy="chunked",
      chunk_size=512,  # most prompt tokens of one request per step; 0 = only the budget caps
      # Preemption when a running request needs a page and none is free.
      preemption_mode="recompute",  # recompute | swap | abort
      num_host_pages=0,  # host swap pool; Scheduler(num_host_pages=...) overrides it
      # Async scheduling (vLLM's --async-scheduling): schedule and launch step N+1 while
      # step N runs, so host work hides behind the device. Real runs only: a simulated
      # GPU runs on virtual time, with no host work to hide.
      async_scheduling=True,
      # Multi-step decoding (vLLM's multi-step scheduling, --num-scheduler-steps): when a
      # step is all decodes and nothing waits to join, run this many decode iterations
      # in one device launch, feeding each sample to the next on the device. Host work
      # and launch cost are paid once per launch; a request arriving meanwhile waits up
      # to that many iterations to join, and a stop token is seen only at the end.
      num_decode_steps=1,
  ))


_POSITIVE_INTS = ("max_num_seqs", "max_num_batched_tokens", "max_waiting",
                  "fixed_output_estimate", "output_estimate_window", "num_decode_steps")
_NON_NEGATIVE_INTS = ("chunk_size", "num_host_pages")
_POSITIVE_FLOATS = ("retry_after_window_s", "default_retry_after_s", "max_retry_after_s")


def _check_choice(config: ml_collections.ConfigDict, key: str, choices: tuple[str, ...]) -> None:
  if config[key] not in choices:
    raise ValueError(f"unknown scheduler.{key} {config[key]!r}; choose one of: "
                     f"{', '.join(choices)}")


def check(config: ml_collections.ConfigDict, max_model_len: int) -> None:
  """Raises ValueError naming the valid choices for any bad knob in a scheduler section."""
  for key in _POSITIVE_INTS + _NON_NEGATIVE_INTS:
    value, low = config[key], (1 if key in _POSITIVE_INTS else 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ValueError(f"scheduler.{key} must be an integer >= {low}, got {value!r}")
  for key in _POSITIVE_FLOATS:
    if not config[key] > 0:
      raise ValueError(f"scheduler.{key} must be > 0, got {config[key]!r}")
  if config.num_decode_steps > MAX_DECODE_STEPS:
    raise ValueError(f"scheduler.num_decode_steps must be at most {MAX_DECODE_STEPS}, got "
                     f"{config.num_decode_steps}")
  if not isinstance(config.async_scheduling, bool):
    raise ValueError(f"scheduler.async_scheduling must be true or false, got "
                     f"{config.async_scheduling!r}")
  if not 0 <= config.watermark < 1:
    raise ValueError(f"scheduler.watermark must be a fraction in [0, 1), got {config.watermark}")
  _check_choice(config, "output_estimate", OUTPUT_ESTIMATES)
  _check_choice(config, "prefill_policy", PREFILL_POLICIES)
  _check_choice(config, "preemption_mode", PREEMPTION_MODES)
  if config.prefill_policy == "none" and config.max_num_batched_tokens < max_model_len:
    # A whole prompt (or a recomputed prompt + output) must fit one step's budget.
    raise ValueError(
        f"prefill_policy 'none' needs max_num_batched_tokens >= max_model_len "
        f"({config.max_num_batched_tokens} < {max_model_len}); raise it or choose 'chunked'")
