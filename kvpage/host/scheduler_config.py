"""What a `scheduler` config section may hold: the choices, the bounds, and `check`.

The defaults are templates and live with the other configs (`configs/scheduler.py`);
what the scheduler can run lives here, next to the scheduler, which checks every
section it is given. Pure Python: never imports jax.
"""

import ml_collections

ADMISSIONS = ("watermark", "queue_only")
OUTPUT_ESTIMATES = ("max_tokens", "fixed", "running_mean")
PREFILL_POLICIES = ("none", "chunked")
PREEMPTION_MODES = ("recompute", "swap", "abort")
MAX_DECODE_STEPS = 256  # a launch returns [num_decode_steps, rows] samples

_POSITIVE_INTS = ("max_num_seqs", "max_num_batched_tokens", "fixed_output_estimate",
                  "output_estimate_window", "num_decode_steps", "step_cost_window",
                  "rate_burst")
_NON_NEGATIVE_INTS = ("max_waiting", "chunk_size", "num_host_pages", "retry_jitter_seed",
                      "max_concurrent", "max_inflight_tokens", "retry_audit")
_POSITIVE_FLOATS = ("default_retry_after_s", "max_retry_after_s", "retry_grace_s")
_NON_NEGATIVE_FLOATS = ("rate_limit", "max_forecast_ttft_s", "max_ttft_slowdown")  # 0 = off


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
  for key in _NON_NEGATIVE_FLOATS:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
      raise ValueError(f"scheduler.{key} must be >= 0 (0 = off), got {value!r}")
  if 0 < config.max_ttft_slowdown < 1:  # below 1 even an idle engine is too slow
    raise ValueError(f"scheduler.max_ttft_slowdown must be 0 (off) or >= 1, got "
                     f"{config.max_ttft_slowdown!r}")
  if not 0 <= config.retry_jitter <= 1:
    raise ValueError(f"scheduler.retry_jitter must be a fraction in [0, 1], got "
                     f"{config.retry_jitter!r}")
  if config.num_decode_steps > MAX_DECODE_STEPS:
    raise ValueError(f"scheduler.num_decode_steps must be at most {MAX_DECODE_STEPS}, got "
                     f"{config.num_decode_steps}")
  for key in ("async_scheduling", "retry_reservations"):
    if not isinstance(config[key], bool):
      raise ValueError(f"scheduler.{key} must be true or false, got {config[key]!r}")
  if not 0 <= config.watermark < 1:
    raise ValueError(f"scheduler.watermark must be a fraction in [0, 1), got {config.watermark}")
  _check_choice(config, "admission", ADMISSIONS)
  _check_choice(config, "output_estimate", OUTPUT_ESTIMATES)
  _check_choice(config, "prefill_policy", PREFILL_POLICIES)
  _check_choice(config, "preemption_mode", PREEMPTION_MODES)
  if config.prefill_policy == "none" and config.max_num_batched_tokens < max_model_len:
    # A whole prompt (or a recomputed prompt + output) must fit one step's budget.
    raise ValueError(
        f"prefill_policy 'none' needs max_num_batched_tokens >= max_model_len "
        f"({config.max_num_batched_tokens} < {max_model_len}); raise it or choose 'chunked'")
