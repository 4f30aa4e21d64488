"""How many requests of a given length fit on a device: the KV-cache capacity model.

Decode re-reads every earlier token's keys and values, so each request carries a
KV cache that grows with its length:

    kv_bytes_per_token = 2 (K and V) x bytes_per_element x num_layers x num_kv_heads x head_dim

Grouped-query attention (GQA) shares one KV head among `num_heads / num_kv_heads`
query heads and divides that figure by the same ratio. A device holds the weights,
a reserve for activations and workspace, and a pool of KV pages with what is left;
a paged cache (PagedAttention, Kwon et al., SOSP'23) hands a request whole pages
of `page_size` tokens, so a request of S tokens occupies ceil(S / page_size) pages.

The shapes and bytes themselves (`ModelShape`, KV and weight bytes) are
`kvpage.model_shape`'s, which real runs use too. Pure Python: never imports jax.
"""

import dataclasses
from collections.abc import Sequence

from kvpage.model_shape import (
    ModelShape,
    check_positive,
    check_tensor_parallel,
    kv_bytes_per_token,
    weight_bytes,
)
from kvpage.units import canonical_dtype, cdiv

DEFAULT_PAGE_SIZE = 16


def pages_for_tokens(num_tokens: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
  """Pages a sequence of `num_tokens` occupies in a paged cache (ceil division)."""
  check_positive("page_size", page_size)
  if num_tokens < 0:
    raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
  return cdiv(num_tokens, page_size)


def kv_bytes_per_request(model: ModelShape, dtype: str, seq_len: int,
                         page_size: int | None = None) -> int:
  """KV bytes of one request of `seq_len` tokens; rounded up to whole pages if `page_size`."""
  check_positive("seq_len", seq_len)
  tokens = seq_len if page_size is None else pages_for_tokens(seq_len, page_size) * page_size
  return kv_bytes_per_token(model, dtype) * tokens


def kv_pool_pages(memory_bytes: int, weight_bytes: int, page_bytes: int,
                  reserve_bytes: int = 0) -> int:
  """Pages of `page_bytes` that fit in device memory after the weights and a reserve."""
  check_positive("page_bytes", page_bytes)
  if reserve_bytes < 0:
    raise ValueError(f"reserve must be >= 0 bytes, got {reserve_bytes}")
  free = memory_bytes - weight_bytes - reserve_bytes
  if free < 0:
    raise ValueError(
        f"device memory ({memory_bytes:,} bytes) is smaller than weights ({weight_bytes:,}) "
        f"plus reserve ({reserve_bytes:,}): the model does not fit"
    )
  return free // page_bytes


def page_waste(seq_len: int, page_size: int = DEFAULT_PAGE_SIZE) -> tuple[int, float]:
  """Token slots a paged cache reserves but leaves empty for one request, and their fraction."""
  check_positive("seq_len", seq_len)
  reserved = pages_for_tokens(seq_len, page_size) * page_size
  return reserved - seq_len, (reserved - seq_len) / reserved


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
  """Every premise and every result of one capacity calculation."""

  model: str
  weight_dtype: str
  kv_dtype: str
  tensor_parallel: int
  seq_len: int
  page_size: int
  memory_bytes: int
  weight_bytes: int
  reserve_bytes: int
  kv_bytes_per_token: int
  kv_bytes_per_request: int
  kv_pool_bytes: int
  pool_pages: int
  pool_tokens: int
  pages_per_request: int
  max_concurrent_requests: int
  page_waste_tokens: int
  page_waste_fraction: float


def plan(model: ModelShape, *, seq_len: int, memory_bytes: int, weight_dtype: str,
         kv_dtype: str | None = None, page_size: int = DEFAULT_PAGE_SIZE,
         weight_bytes_override: int | None = None, reserve_bytes: int = 0,
         tensor_parallel: int = 1) -> CapacityPlan:
  """How many fully-grown requests of `seq_len` tokens a device holds at once.

  The pool is carved into pages of `page_size` tokens after the weights and the
  reserve; a request needs ceil(seq_len / page_size) pages. `weight_bytes_override`
  replaces the weight bytes computed from the model's dimensions. Over a
  `tensor_parallel` group every figure is one device's: its share of the weights
  (`weight_bytes_override` too is the whole model's) and of every page (its KV heads),
  so the group holds as many requests as one device's pool does.
  """
  check_positive("seq_len", seq_len)
  check_positive("page_size", page_size)
  check_tensor_parallel(model, tensor_parallel)
  kv_dtype = canonical_dtype(kv_dtype or weight_dtype)
  weights = cdiv(weight_bytes(model, weight_dtype) if weight_bytes_override is None
                 else weight_bytes_override, tensor_parallel)
  per_token = kv_bytes_per_token(model, kv_dtype, tensor_parallel)
  page_bytes = per_token * page_size
  pool_pages = kv_pool_pages(memory_bytes, weights, page_bytes, reserve_bytes)
  pages_per_request = pages_for_tokens(seq_len, page_size)
  waste_tokens, waste_fraction = page_waste(seq_len, page_size)
  return CapacityPlan(
      model=model.name, weight_dtype=canonical_dtype(weight_dtype), kv_dtype=kv_dtype,
      tensor_parallel=tensor_parallel, seq_len=seq_len, page_size=page_size,
      memory_bytes=memory_bytes, weight_bytes=weights,
      reserve_bytes=reserve_bytes, kv_bytes_per_token=per_token,
      kv_bytes_per_request=per_token * seq_len,
      kv_pool_bytes=memory_bytes - weights - reserve_bytes, pool_pages=pool_pages,
      pool_tokens=pool_pages * page_size, pages_per_request=pages_per_request,
      max_concurrent_requests=pool_pages // pages_per_request,
      page_waste_tokens=waste_tokens, page_waste_fraction=waste_fraction,
  )



def requests_that_fit(model: ModelShape, *, seq_lens: Sequence[int], memory_bytes: int,
                      weight_dtype: str, kv_dtype: str | None = None,
                      page_size: int = DEFAULT_PAGE_SIZE) -> list[int]:
  """`plan(...).max_concurrent_requests` at each of `seq_lens`: the capacity curve."""
  return [plan(model, seq_len=seq_len, memory_bytes=memory_bytes, weight_dtype=weight_dtype,
               kv_dtype=kv_dtype, page_size=page_size).max_concurrent_requests
          for seq_len in seq_lens]


@dataclasses.dataclass(frozen=True)
class Fragmentation:
  """KV memory reserved by a paged cache vs contiguous max-length preallocation.

  Token counts are slots; bytes are slots x `kv_bytes_per_token`. Utilization is the
  fraction of reserved slots that hold real tokens; waste is one minus that.
  """

  num_sequences: int
  page_size: int
  max_len: int
  used_tokens: int
  paged_reserved_tokens: int
  contiguous_reserved_tokens: int
  used_bytes: int
  paged_reserved_bytes: int
  contiguous_reserved_bytes: int
  paged_utilization: float
  contiguous_utilization: float
  paged_waste: float
  contiguous_waste: float


def fragmentation(lengths: Sequence[int], *, max_len: int,
                  page_size: int = DEFAULT_PAGE_SIZE,
                  kv_bytes_per_token: int = 1) -> Fragmentation:
  """Reserved vs used KV memory for sequences of `lengths` under both schemes.

  A paged cache reserves ceil(length / page_size) pages per sequence; a contiguous
  cache reserves `max_len` slots per sequence, whatever its final length.
  """
  check_positive("max_len", max_len)
  if not lengths:
    raise ValueError("lengths must not be empty")
  for length in lengths:
    check_positive("each sequence length", int(length))
    if length > max_len:
      raise ValueError(f"sequence length {length} exceeds max_len={max_len}")
  used = int(sum(lengths))
  paged = sum(pages_for_tokens(int(n), page_size) for n in lengths) * page_size
  contiguous = len(lengths) * max_len
  return Fragmentation(
      num_sequences=len(lengths), page_size=page_size, max_len=max_len, used_tokens=used,
      paged_reserved_tokens=paged, contiguous_reserved_tokens=contiguous,
      used_bytes=used * kv_bytes_per_token, paged_reserved_bytes=paged * kv_bytes_per_token,
      contiguous_reserved_bytes=contiguous * kv_bytes_per_token,
      paged_utilization=used / paged, contiguous_utilization=used / contiguous,
      paged_waste=1 - used / paged, contiguous_waste=1 - used / contiguous)


def requests_with_shared_prefix(capacity_plan: CapacityPlan, prefix_tokens: int,
                                num_groups: int) -> int:
  """Requests that fit at once when each starts with one of `num_groups` prefixes of
  `prefix_tokens` tokens and prefix caching holds each prefix's full pages once: the
  pool less the groups' shared pages, over the pages each request adds (its last
  prompt token is computed anew, so at most `seq_len - 1` tokens are shared)."""
  page_size = capacity_plan.page_size
  shared = min(prefix_tokens, capacity_plan.seq_len - 1) // page_size
  own = capacity_plan.pages_per_request - shared
  free = capacity_plan.pool_pages - num_groups * shared
  return max(0, free // own) if free > 0 else 0
