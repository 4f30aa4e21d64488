"""The units both worlds count in: pages, the null page, and the one table of dtypes.

The host counts KV memory in pages (`cdiv(tokens, page_size)`), the device stores it
in arrays of some dtype, and the capacity model prices both in bytes. They must agree
on every figure, so each is defined once, here. Pure Python: never imports jax (the
device turns a dtype's `array_name` into a jnp dtype itself).
"""

import dataclasses
from typing import Any

# Page 0 of the device pool is reserved: padding tokens write there and padded
# page-table entries point there, so the page pool never hands it out.
NULL_PAGE = 0


def cdiv(a: Any, b: Any) -> Any:
  """Ceiling division, for ints and for traced integer arrays alike."""
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class DType:
  """One storage precision: its short name, bytes per element, and numpy/jnp name."""

  name: str
  num_bytes: int
  array_name: str  # what `jnp.dtype(...)` and `np.dtype(...)` call it
  # The paged cache stores it as is; int8 would need quantization scales it does not keep.
  storable: bool = True


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("fp32", 4, "float32"),
    DType("bf16", 2, "bfloat16"),
    DType("fp16", 2, "float16"),
    DType("fp8", 1, "float8_e4m3fn"),
    DType("int8", 1, "int8", storable=False),
)}
# Other spellings users and checkpoints write (Hugging Face's `torch_dtype` among them).
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
            "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


def canonical_dtype(dtype: str) -> str:
  """Maps a dtype name (`bf16`, `bfloat16`, ...) to its short name, or raises ValueError."""
  name = _ALIASES.get(str(dtype), str(dtype))
  if name not in DTYPES:
    raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
  return name


def dtype_bytes(dtype: str) -> int:
  """Bytes per element of `dtype`."""
  return DTYPES[canonical_dtype(dtype)].num_bytes
