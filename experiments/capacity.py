r"""Capacity report: how many requests of a given length fit on a device.

  python -m experiments.capacity --config=configs/llama_13b.py --hardware=a100_80gb

It prints the same calculation under two sets of premises side by side, so a reader
sees how premises move the figure:
  * `nominal`: the back-of-envelope — the card's marketed size read as 10^9 bytes
    ("80 GB" = 80e9) and the weights rounded to whole decimal GB;
  * `exact`: the memory the driver reports (binary units, 80 GiB) and the weights
    computed from the model's exact parameter count.
`--memory_gb`, `--weights_gb` and `--reserve_gb` add a `given` column (units per
`--units`: `gb` = 10^9 bytes, `gib` = 2^30 bytes) that `--json` reports as primary.
"""

import dataclasses
import json

from absl import flags

from configs import base as configs_check
from configs import hardware as hardware_lib
from experiments import cli
from kvpage import model_shape, units
from kvpage.sim import capacity, workload

_CONFIG = cli.define_config("configs/llama_13b.py",
                            "Model config file (`path.py` or `path.py:variant`).")
_HARDWARE = flags.DEFINE_string(
    "hardware", None, f"Device; one of {sorted(hardware_lib.HARDWARE)}. Default: the config's.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "Tokens per fully-grown request.")
_DTYPE = flags.DEFINE_string("dtype", None, "Weight and KV dtype. Default: the config's.")
_KV_DTYPE = flags.DEFINE_string("kv_dtype", None, "KV-cache dtype if it differs from --dtype.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
# The name vLLM and the PagedAttention paper use for a page; kept as an alias.
flags.DEFINE_alias("block_size", "page_size")
_MEMORY_GB = flags.DEFINE_float("memory_gb", None, "Override device memory (see --units).")
_WEIGHTS_GB = flags.DEFINE_float("weights_gb", None, "Override weight bytes (see --units).")
_RESERVE_GB = flags.DEFINE_float(
    "reserve_gb", 0.0, "Memory kept for activations/workspace (see --units).")
_UNITS = flags.DEFINE_string("units", "gb", "`gb` = 10^9 bytes or `gib` = 2^30 bytes.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
_SHARED_PREFIX = flags.DEFINE_string(
    "shared_prefix", "", "TOKENS:GROUPS: every request starts with one of GROUPS prefixes of "
    "TOKENS tokens (of its --seq_len); adds the requests that fit with prefix caching.")
_TENSOR_PARALLEL = cli.define_tensor_parallel()

UNIT_BYTES = {"gb": 10**9, "gib": 2**30}


MAX_SIZE = 10**9  # in --units: an exabyte-scale size is a typo, not a device


def _to_bytes(value: float | None, unit: str, name: str = "size") -> int | None:
  if value is None:
    return None
  if not 0 <= value <= MAX_SIZE:  # NaN fails too
    raise ValueError(f"--{name} must be a number in [0, {MAX_SIZE:,}] {unit}, got {value}")
  return round(value * UNIT_BYTES[unit])


def build_plans(config, hardware: hardware_lib.HardwareSpec, *, seq_len: int, dtype: str,
                kv_dtype: str, page_size: int, unit: str, memory_gb: float | None,
                weights_gb: float | None, reserve_gb: float) -> dict[str, capacity.CapacityPlan]:
  """The `nominal`, `exact` and (with overrides) `given` plans, keyed by name."""
  model = model_shape.ModelShape.from_config(config.model)
  reserve = _to_bytes(reserve_gb, unit, "reserve_gb")
  exact_weights = model_shape.weight_bytes(model, dtype)
  common = dict(seq_len=seq_len, weight_dtype=dtype, kv_dtype=kv_dtype, page_size=page_size,
                reserve_bytes=reserve, tensor_parallel=config.mesh.tensor_parallel)
  plans = {
      "nominal": capacity.plan(
          model, memory_bytes=round(hardware.nominal_memory_gb * 10**9),
          weight_bytes_override=round(exact_weights / 10**9) * 10**9, **common),
      "exact": capacity.plan(model, memory_bytes=hardware.memory_bytes, **common),
  }
  if memory_gb is not None or weights_gb is not None:
    plans["given"] = capacity.plan(
        model, memory_bytes=(hardware.memory_bytes if memory_gb is None
                             else _to_bytes(memory_gb, unit, "memory_gb")),
        weight_bytes_override=_to_bytes(weights_gb, unit, "weights_gb"), **common)
  return plans


def _row(label: str, values: list[str]) -> str:
  return f"  {label:<34}" + "".join(f"{v:>24}" for v in values)


def format_report(plans: dict[str, capacity.CapacityPlan], model_name: str,
                  hardware: hardware_lib.HardwareSpec, unit: str,
                  shared_prefix: tuple[int, int] = (0, 0)) -> str:
  """A table: premises first, then one column per plan."""
  first = next(iter(plans.values()))
  scale, unit_label = UNIT_BYTES[unit], {"gb": "GB = 10^9 bytes", "gib": "GiB = 2^30 bytes"}[unit]
  lines = [
      "kvpage capacity report",
      f"  model        {model_name} ({first.weight_dtype} weights, {first.kv_dtype} KV cache)",
      f"  sequence     {first.seq_len:,} tokens per fully-grown request",
      f"  page size    {first.page_size} tokens per KV page",
      f"  hardware     {hardware.name}: {hardware.source}",
      *([f"  devices      tensor parallel {first.tensor_parallel}: weights and KV heads split "
         "over them; every figure below is one device's"] if first.tensor_parallel > 1 else []),
      f"  units        {unit_label}; byte counts are exact",
      "  premises     nominal = marketed size read as 10^9 bytes, weights rounded to whole GB;",
      "               exact = driver-reported memory, weights from the exact parameter count",
      "",
      _row("", list(plans)),
  ]

  def gb(value: int) -> str:
    return f"{value / scale:,.2f} {'GB' if unit == 'gb' else 'GiB'}"

  rows = [
      ("device memory", lambda p: f"{gb(p.memory_bytes)} = {p.memory_bytes / 2**30:,.2f} GiB"),
      ("weights", lambda p: gb(p.weight_bytes)),
      ("reserve (activations/workspace)", lambda p: gb(p.reserve_bytes)),
      ("KV pool", lambda p: gb(p.kv_pool_bytes)),
      ("KV bytes per token", lambda p: f"{p.kv_bytes_per_token:,}"),
      ("KV bytes per request", lambda p: f"{p.kv_bytes_per_request:,}"),
      ("pages in pool", lambda p: f"{p.pool_pages:,}"),
      ("tokens in pool", lambda p: f"{p.pool_tokens:,}"),
      ("pages per request", lambda p: f"{p.pages_per_request:,}"),
      ("block-rounding waste per request", lambda p: f"{p.page_waste_tokens} tok "
       f"({p.page_waste_fraction:.1%})"),
      ("MAX CONCURRENT REQUESTS", lambda p: f"{p.max_concurrent_requests:,}"),
  ]
  prefix_tokens, groups = shared_prefix
  if groups:
    rows.append((f"... SHARING {groups} PREFIX(ES) OF {prefix_tokens:,}",
                 lambda p: f"{capacity.requests_with_shared_prefix(p, prefix_tokens, groups):,}"))
  lines += [_row(label, [fn(p) for p in plans.values()]) for label, fn in rows]
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = cli.load_config_with_mesh(_CONFIG, _TENSOR_PARALLEL)
  configs_check.check(config)
  if _UNITS.value not in UNIT_BYTES:
    raise ValueError(f"unknown --units {_UNITS.value!r}; choose one of: gb, gib")
  hardware = hardware_lib.get_hardware(_HARDWARE.value or config.hardware)
  dtype = units.canonical_dtype(_DTYPE.value or config.model.dtype)
  kv_dtype = units.canonical_dtype(_KV_DTYPE.value or _DTYPE.value or config.cache.kv_dtype)
  plans = build_plans(config, hardware, seq_len=_SEQ_LEN.value, dtype=dtype,
                      kv_dtype=kv_dtype, page_size=_PAGE_SIZE.value, unit=_UNITS.value,
                      memory_gb=_MEMORY_GB.value, weights_gb=_WEIGHTS_GB.value,
                      reserve_gb=_RESERVE_GB.value)
  prefix_tokens, groups = workload.parse_shared_prefix(_SHARED_PREFIX.value)
  if groups and prefix_tokens >= _SEQ_LEN.value:
    raise ValueError(f"--shared_prefix={_SHARED_PREFIX.value}: a prefix of {prefix_tokens:,} "
                     f"tokens must be shorter than --seq_len={_SEQ_LEN.value:,}, the whole "
                     "request it starts")
  if _JSON.value:
    primary = plans.get("given", plans["exact"])
    record = dataclasses.asdict(primary)
    record.update(hardware=hardware.name, hardware_source=hardware.source,
                  units="bytes", scenarios={k: dataclasses.asdict(v) for k, v in plans.items()})
    if groups:
      record["shared_prefix"] = dict(
          prefix_tokens=prefix_tokens, groups=groups,
          max_concurrent_requests=capacity.requests_with_shared_prefix(
              primary, prefix_tokens, groups))
    print(json.dumps(record, indent=2))
  else:
    print(format_report(plans, config.model.name, hardware, _UNITS.value,
                        (prefix_tokens, groups)))


if __name__ == "__main__":
  cli.run(main)
