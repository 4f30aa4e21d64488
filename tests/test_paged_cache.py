"""Writes through slot_mapping and reads through page tables round-trip exactly."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import tiny
from kvpage import model_shape, units
from kvpage.device import cache as paged_cache

MODEL = tiny.get_config().model


def read_sequence(cache: paged_cache.PagedKVCache, layer: int, page_table: np.ndarray,
                  length: int) -> tuple[np.ndarray, np.ndarray]:
  """A sequence's keys and values, `[length, num_kv_heads, head_dim]` each, read on the
  host (numpy indexing compiles nothing, whatever the length)."""
  positions = np.arange(length)
  pages = page_table[positions // cache.page_size]
  offsets = positions % cache.page_size
  k = np.asarray(cache.k_pages[layer])[:, pages, offsets, :].transpose(1, 0, 2)
  v = np.asarray(cache.v_pages[layer])[:, pages, offsets, :].transpose(1, 0, 2)
  return k, v


def slots_for(pages: np.ndarray, start: int, count: int, page_size: int) -> np.ndarray:
  positions = np.arange(start, start + count)
  return (pages[positions // page_size] * page_size + positions % page_size).astype(np.int32)


def test_init_shapes_and_budget():
  cache = paged_cache.init(MODEL, num_pages=10, page_size=16)
  assert cache.k_pages.shape == (4, 2, 10, 16, 64) and cache.dtype == jnp.float32
  per_page = model_shape.kv_bytes_per_token(model_shape.ModelShape.from_config(MODEL), "fp32") * 16
  assert paged_cache.num_pages_for_budget(MODEL, memory_bytes=per_page * 37 + 5,
                                          page_size=16) == 37
  num_pages = paged_cache.num_pages_for_budget(MODEL, memory_bytes=per_page * 8,
                                               page_size=16, dtype="bf16")
  cache = paged_cache.init(MODEL, num_pages=num_pages, page_size=16, dtype="bf16")
  assert cache.num_pages == 16 and cache.dtype == jnp.bfloat16  # bf16 halves the page bytes
  assert cache.num_bytes == per_page * 8
  with pytest.raises(ValueError, match="null page"):
    paged_cache.init(MODEL, num_pages=1, page_size=16)
  with pytest.raises(ValueError, match="not supported"):
    paged_cache.init(MODEL, num_pages=4, page_size=16, dtype="int8")


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       page_size=st.sampled_from([1, 3, 4, 16]), chunk=st.integers(1, 17),
       seed=st.integers(0, 2**16))
def test_write_then_read_round_trips(lengths, page_size, chunk, seed):
  """Sequences written chunk by chunk into permuted pages read back exactly."""
  rng = np.random.default_rng(seed)
  config = {**MODEL, "num_layers": 2}
  needed = [-(-n // page_size) for n in lengths]
  # One pool size and one write width for every example, so `write` compiles once per
  # (page size, layer), not once per drawn shape: spare pages stay unwritten.
  num_pages = 1 + 4 * 40
  order = rng.permutation(np.arange(1, 1 + sum(needed)))
  tables = np.split(order, np.cumsum(needed)[:-1])
  cache = paged_cache.init(config, num_pages=num_pages, page_size=page_size)
  truth = [rng.standard_normal((2, n, 2, 64)).astype(np.float32) for n in lengths]
  write = jax.jit(paged_cache.write, static_argnums=1, donate_argnums=0)
  for start in range(0, max(lengths), chunk):
    for layer in range(2):
      ks, vs, slots = [], [], []
      for table, n, kv in zip(tables, lengths, truth):
        count = max(0, min(chunk, n - start))
        ks.append(kv[0, start:start + count])
        vs.append(-kv[0, start:start + count])
        slots.append(slots_for(table, start, count, page_size))
      num_pad = 4 * 17 + 3 - sum(len(slot) for slot in slots)  # padding: null-page slots
      ks.append(np.full((num_pad, 2, 64), 7.0, np.float32))
      vs.append(np.full((num_pad, 2, 64), 7.0, np.float32))
      slots.append(np.arange(num_pad, dtype=np.int32) % page_size)
      cache = write(cache, layer, np.concatenate(ks), np.concatenate(vs), np.concatenate(slots))
  for table, n, kv in zip(tables, lengths, truth):
    for layer in range(2):
      k, v = read_sequence(cache, layer, table, n)
      np.testing.assert_array_equal(k, kv[0])
      np.testing.assert_array_equal(v, -kv[0])
  # Padding wrote only into the null page: every real page holds real data or zeros.
  real_pages = np.asarray(cache.k_pages)[:, :, 1:]
  assert not np.any(real_pages == 7.0)


def test_write_is_in_place_under_donation():
  cache = paged_cache.init(MODEL, num_pages=8, page_size=4)
  traces = []

  @functools.partial(jax.jit, donate_argnums=0)
  def step(cache, k, slots):
    traces.append(1)
    return paged_cache.write(cache, 1, k, k, slots)

  k = jnp.ones((5, 2, 64))
  pointer = cache.k_pages.unsafe_buffer_pointer()
  cache = step(cache, k, jnp.arange(4, 9, dtype=jnp.int32))
  cache = step(cache, 2 * k, jnp.arange(9, 14, dtype=jnp.int32))
  assert len(traces) == 1
  assert cache.k_pages.unsafe_buffer_pointer() == pointer  # donated: updated in place
  flat = np.asarray(cache.k_pages[1]).reshape(2, 32, 64)
  assert np.all(flat[:, 4:9] == 1) and np.all(flat[:, 9:14] == 2) and not np.any(flat[:, 14:])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_swap_pool_round_trips_pages_and_pads_into_the_null_page(dtype):
  config = {**MODEL, "num_layers": 2}
  rng = np.random.default_rng(0)
  cache = paged_cache.init(config, num_pages=10, page_size=4, dtype=dtype)
  shape, np_dtype = cache.k_pages.shape, cache.dtype
  k = rng.standard_normal(shape).astype(np_dtype)
  v = rng.standard_normal(shape).astype(np_dtype)
  cache = cache.replace(k_pages=jax.device_put(k), v_pages=jax.device_put(v))
  pool = paged_cache.HostSwapPool(cache, num_pages=6)
  copies_out = [(3, 5), (7, 0), (2, 2)]  # three copies: padded to four with the null page
  with jax.transfer_guard("disallow"):  # every copy is an explicit transfer
    pool.swap_out(cache, copies_out)
  for device_page, host_page in copies_out:
    assert pool.k[:, :, host_page].tobytes() == k[:, :, device_page].tobytes()
    assert pool.v[:, :, host_page].tobytes() == v[:, :, device_page].tobytes()
  assert not np.any(pool.k[:, :, [1, 3, 4]].astype(np.float32))  # other host pages untouched

  # Back into other device pages of a cache whose every page, null page included,
  # holds 7s: the copies land where asked, padding only zeroes the null page.
  target = paged_cache.init(config, num_pages=10, page_size=4, dtype=dtype)
  sevens = np.full(shape, 7, np_dtype)
  target = target.replace(k_pages=jax.device_put(sevens), v_pages=jax.device_put(sevens))
  copies_in = [(5, 8), (0, 1), (2, 4)]
  with jax.transfer_guard("disallow"):
    target = pool.swap_in(target, copies_in)
  k_back, v_back = np.asarray(target.k_pages), np.asarray(target.v_pages)
  for (_, device_page), (source, _) in zip(copies_in, copies_out):
    assert k_back[:, :, device_page].tobytes() == k[:, :, source].tobytes()
    assert v_back[:, :, device_page].tobytes() == v[:, :, source].tobytes()
  assert not np.any(k_back[:, :, units.NULL_PAGE].astype(np.float32))
  untouched = [page for page in range(1, 10) if page not in (8, 1, 4)]
  assert k_back[:, :, untouched].tobytes() == sevens[:, :, untouched].tobytes()
  assert v_back[:, :, untouched].tobytes() == sevens[:, :, untouched].tobytes()


def test_swap_pool_copies_compile_once_per_power_of_two():
  cache = paged_cache.init({**MODEL, "num_layers": 1}, num_pages=12, page_size=2)
  pool = paged_cache.HostSwapPool(cache, num_pages=8)
  # jit caches per function, across pools: count the programs this test adds.
  before = pool._scatter._cache_size(), pool._gather._cache_size()
  compiles = []
  for count in (3, 4, 2, 5):
    cache = pool.swap_in(cache, [(i, 1 + i) for i in range(count)])
    pool.swap_out(cache, [(1 + i, i) for i in range(count)])
    compiles.append((pool._scatter._cache_size() - before[0],
                     pool._gather._cache_size() - before[1]))
  # 3 and 4 copies share the 4-page program; 2 and 5 need their own (2, then 8).
  assert compiles == [(1, 1), (1, 1), (2, 2), (3, 3)]
