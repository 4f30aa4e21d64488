"""Shared builder for config files: a model from the table plus the serving knobs.

A config has three sections:
  * `model`: dimensions from `configs.model_table` plus the weight `dtype`;
  * `cache`: paged KV-cache layout (`page_size`, `kv_dtype`, `num_pages` or a budget);
  * `hardware`: a key into `configs.hardware.HARDWARE`.
Later sections (scheduler, engine) are added by the modules that own them.
"""

import ml_collections

from configs import model_table, scheduler
from kvpage import units

DTYPES = tuple(units.DTYPES)


def model_config(name: str, dtype: str) -> ml_collections.ConfigDict:
  """The `model` section for table entry `name` stored in `dtype`."""
  if name not in model_table.MODEL_TABLE:
    raise ValueError(
        f"unknown model {name!r}; choose one of: {', '.join(sorted(model_table.MODEL_TABLE))}"
    )
  config = ml_collections.ConfigDict(dict(model_table.MODEL_TABLE[name]))
  config.name = name
  config.dtype = dtype
  config.rope_scaling = ml_collections.ConfigDict(
      dict(enabled=False, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
           original_max_seq_len=8192)
  )
  config.attention_impl = "xla"  # kvpage.device.attention.ATTENTION_IMPLS
  return config


def build(name: str, default_dtype: str, variant: str | None,
          hardware: str) -> ml_collections.ConfigDict:
  """A full config; `variant` (the part after `:` in `--config=file.py:variant`) is a dtype."""
  dtype = variant or default_dtype
  if dtype not in DTYPES:
    raise ValueError(f"unknown config variant {variant!r}; choose a dtype: {', '.join(DTYPES)}")
  config = ml_collections.ConfigDict()
  config.model = model_config(name, dtype)
  config.cache = ml_collections.ConfigDict(dict(page_size=16, kv_dtype=dtype, num_pages=0))
  config.hardware = hardware
  config.seed = 0
  config.scheduler = scheduler.get_scheduler_config()
  return config
