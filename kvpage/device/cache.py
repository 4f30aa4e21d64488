"""The paged KV cache: one pool of fixed-size pages per layer, addressed through slots.

PagedAttention (Kwon et al., SOSP'23) stores a sequence's keys and values in pages of
`page_size` tokens scattered anywhere in one pool, found through the sequence's page
table, so no sequence preallocates its maximum length. The layout is head-major,

    k_pages, v_pages: [num_layers, num_kv_heads, num_pages, page_size, head_dim]

the layout of JAX's own Pallas paged-attention kernels, so kernels are
interchangeable. Page 0 is the **null page**: padding tokens write there and padded
page-table entries point there; the host's page pool never hands it out.

A token's slot is `page * page_size + offset`. Writes go through a `slot_mapping`
(one slot per new token); reads go through page tables (`kvpage.device.attention`).
Every function here is pure and jit-friendly: pass the cache as a donated argument
and XLA updates the pool in place.

`HostSwapPool` is the host side of swap preemption: a second pool of pages in host
memory, and the two jitted copies that move pages between it and the cache.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kvpage import batch as batch_lib
from kvpage import model_shape, units
from kvpage.device import sharding as sharding_lib


def jnp_dtype(dtype: Any) -> jnp.dtype:
  """A jnp dtype from kvpage's short names (`bf16`, see `kvpage.units`) or anything jnp
  accepts."""
  if isinstance(dtype, str):
    spec = units.DTYPES[units.canonical_dtype(dtype)]
    if not spec.storable:
      storable = ", ".join(name for name, d in units.DTYPES.items() if d.storable)
      raise ValueError(f"dtype {dtype!r} is not supported for cache storage; choose one of: "
                       f"{storable}")
    return jnp.dtype(spec.array_name)
  return jnp.dtype(dtype)


@flax.struct.dataclass
class PagedKVCache:
  """Keys and values of every layer, in pages. A frozen pytree of two arrays."""

  k_pages: jax.Array  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
  v_pages: jax.Array  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]

  @property
  def num_layers(self) -> int:
    return self.k_pages.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.k_pages.shape[1]

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[2]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[3]

  @property
  def head_dim(self) -> int:
    return self.k_pages.shape[4]

  @property
  def dtype(self) -> jnp.dtype:
    return self.k_pages.dtype

  @property
  def num_bytes(self) -> int:
    return 2 * self.k_pages.size * self.k_pages.dtype.itemsize


def _model_dims(model_config: Mapping[str, Any] | Any) -> tuple[int, int, int]:
  shape = model_shape.ModelShape.from_config(model_config)
  return shape.num_layers, shape.num_kv_heads, shape.head_dim


def pool_bytes(model_config: Mapping[str, Any] | Any, *, num_pages: int, page_size: int,
               dtype: Any = None) -> int:
  """Bytes `init` would allocate for these pages (keys and values), allocating nothing;
  so a caller can check a pool against the memory there is before asking for it."""
  num_layers, num_kv_heads, head_dim = _model_dims(model_config)
  itemsize = jnp_dtype(dtype or model_config["dtype"]).itemsize
  return 2 * itemsize * num_layers * num_kv_heads * head_dim * page_size * num_pages


def init(model_config: Mapping[str, Any] | Any, *, num_pages: int, page_size: int,
         dtype: Any = None, sharding: NamedSharding | None = None) -> PagedKVCache:
  """A zeroed cache of `num_pages` pages (page 0, the null page, included).

  `model_config` is a model config section (layers, KV heads, head_dim); `dtype`
  defaults to the model's. `sharding` (tensor parallelism: split on the KV-head axis)
  lays the pool out across devices, each allocating only its own slice.
  """
  if num_pages < 2:
    raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
  if page_size <= 0:
    raise ValueError(f"page_size must be positive, got {page_size}")
  num_layers, num_kv_heads, head_dim = _model_dims(model_config)
  dtype = jnp_dtype(dtype or model_config["dtype"])
  shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
  if sharding is None:
    return PagedKVCache(k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype))
  zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
  return PagedKVCache(k_pages=zeros(), v_pages=zeros())


def num_pages_for_budget(model_config: Mapping[str, Any] | Any, *, memory_bytes: int,
                         page_size: int, dtype: Any = None) -> int:
  """Pages (null page included) that a KV budget of `memory_bytes` holds."""
  shape = model_shape.ModelShape.from_config(model_config)
  itemsize = jnp_dtype(dtype or model_config["dtype"]).itemsize
  page_bytes = 2 * itemsize * shape.num_layers * shape.num_kv_heads * shape.head_dim * page_size
  num_pages = memory_bytes // page_bytes
  if num_pages < 2:
    raise ValueError(f"a KV budget of {memory_bytes:,} bytes holds {num_pages} pages of "
                     f"{page_bytes:,} bytes; at least 2 are needed (page 0 is the null page)")
  return int(num_pages)


def write(cache: PagedKVCache, layer: int, k: jax.Array, v: jax.Array,
          slot_mapping: jax.Array) -> PagedKVCache:
  """`write_layer` on layer `layer` of the whole cache (in place when donated).

  Args:
    k, v: `[num_tokens, num_kv_heads, head_dim]`.
    slot_mapping: `i32[num_tokens]`.
  """
  num_layers, num_kv_heads, num_pages, page_size, head_dim = cache.k_pages.shape
  flat_shape = (num_layers, num_kv_heads, num_pages * page_size, head_dim)
  # x[layer, :, slots, :] has shape [num_tokens, num_kv_heads, head_dim] (numpy rules:
  # advanced indices separated by a slice move to the front), so k needs no transpose.
  k_flat = cache.k_pages.reshape(flat_shape).at[layer, :, slot_mapping, :].set(
      k.astype(cache.dtype))
  v_flat = cache.v_pages.reshape(flat_shape).at[layer, :, slot_mapping, :].set(
      v.astype(cache.dtype))
  return cache.replace(k_pages=k_flat.reshape(cache.k_pages.shape),
                       v_pages=v_flat.reshape(cache.v_pages.shape))


def _gather_pages(cache: PagedKVCache, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
  return cache.k_pages[:, :, pages], cache.v_pages[:, :, pages]


def _scatter_pages(cache: PagedKVCache, pages: jax.Array, k: jax.Array,
                   v: jax.Array) -> PagedKVCache:
  return cache.replace(k_pages=cache.k_pages.at[:, :, pages].set(k),
                       v_pages=cache.v_pages.at[:, :, pages].set(v))


class HostSwapPool:
  """Pages of keys and values in host memory, for requests preempted by swap.

  Host pages are numbered from 0 (the host pool has no null page) and laid out like
  the cache's. Under tensor parallelism (`sharding`, the cache's) each device's slice of
  a page travels between that device and the host, and each process keeps the slices
  its own devices hold. Every copy pads its page list to a power of two with the null page, so
  copies, like steps, compile once per size bucket rather than once per count; the
  padding rows gather the null page and scatter zeros into it, which no real token
  reads. Each copy is one explicit transfer each way (`jax.device_put`,
  `kvpage.device.sharding.host_shards`).
  """

  def __init__(self, cache: PagedKVCache, num_pages: int,
               sharding: NamedSharding | None = None):
    shape = (cache.num_layers, cache.num_kv_heads, num_pages, cache.page_size, cache.head_dim)
    # Zeros from the OS: a process's pages of heads other processes hold are never touched.
    self.k = np.zeros(shape, cache.dtype)
    self.v = np.zeros(shape, cache.dtype)
    self.sharding = sharding
    self._whole = None if sharding is None else NamedSharding(sharding.mesh, PartitionSpec())
    self._gather = jax.jit(_gather_pages, out_shardings=sharding)
    self._scatter = jax.jit(_scatter_pages, donate_argnums=0, out_shardings=sharding)

  @property
  def num_pages(self) -> int:
    return self.k.shape[2]

  def swap_out(self, cache: PagedKVCache, copies: Sequence[tuple[int, int]]) -> None:
    """Copies device pages to host pages: `[(device_page, host_page), ...]`."""
    if not copies:
      return
    device_pages = jax.device_put(_padded([device for device, _ in copies]), self._whole)
    k, v = self._gather(cache, device_pages)
    host_pages, count = [host for _, host in copies], len(copies)
    for pool, pages in ((self.k, k), (self.v, v)):
      for index, part in sharding_lib.host_shards(pages):  # [layers, heads, padded, ...]
        pool[:, index[1], host_pages] = part[:, :, :count]

  def swap_in(self, cache: PagedKVCache, copies: Sequence[tuple[int, int]]) -> PagedKVCache:
    """Copies host pages back to device pages, `[(host_page, device_page), ...]`; returns
    the updated cache (the one passed in is donated)."""
    if not copies:
      return cache
    device_pages = _padded([device for _, device in copies])
    size = len(device_pages)
    k = np.zeros((*self.k.shape[:2], size, *self.k.shape[3:]), self.k.dtype)
    v = np.zeros_like(k)
    host_pages = [host for host, _ in copies]
    k[:, :, :len(copies)] = self.k[:, :, host_pages]
    v[:, :, :len(copies)] = self.v[:, :, host_pages]
    return self._scatter(cache, jax.device_put(device_pages, self._whole),
                         jax.device_put(k, self.sharding), jax.device_put(v, self.sharding))


def _padded(pages: list[int]) -> np.ndarray:
  """`pages` padded with the null page to the next power of two."""
  padded = np.full(batch_lib.page_bucket(len(pages)), units.NULL_PAGE, np.int32)
  padded[:len(pages)] = pages
  return padded
