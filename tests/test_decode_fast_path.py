"""The decode-only fast path: equal to the dense oracle, chosen statically, never recompiling.

`paged_decode_attention` must agree with dense causal attention exactly as the
reference does (fp32 relative error < 1e-5), for contexts taken in one pass or folded
tile by tile, padding rows and sequences, and when reading one layer out of the whole cache.
`batch.build` marks decode-only batches with their type (`DecodeStepBatch`), which is
how the XLA backend's `attend(..., decode_only=...)` picks the path at trace time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import dense_attention, make_case, relative_error

from kvpage import batch as batch_lib
from kvpage.device.attention import reference
from kvpage.device.backends.xla import attention as xla
from kvpage.interface import ScheduledSequence
from kvpage.request import Request, SamplingParams

DECODE_SEQS = [(1, 1), (3, 1), (16, 1), (17, 1), (513, 1)]


def check(case, **kwargs):
  out = np.asarray(xla.paged_decode_attention(
      jnp.asarray(case.q), jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
      page_tables=case.page_tables, context_lens=case.context_lens, **kwargs))
  expected = dense_attention(case, kwargs.get("sm_scale"), kwargs.get("soft_cap"))
  assert relative_error(out[:case.num_real_tokens], expected) < 1e-5
  assert not np.any(out[case.num_real_tokens:])  # padding rows are exact zeros
  return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("tokens_per_tile", [16, 128, 4096])
def test_decode_matches_dense(page_size, group, tokens_per_tile):
  case = make_case(DECODE_SEQS, num_heads=2 * group, num_kv_heads=2, head_dim=16,
                   page_size=page_size, seed=page_size + group, num_pad_tokens=2,
                   num_pad_seqs=1)
  check(case, tokens_per_tile=tokens_per_tile)


def test_scale_soft_cap_and_whole_cache_layer():
  case = make_case([(33, 1), (9, 1), (64, 1)], num_heads=4, num_kv_heads=2, head_dim=16,
                   page_size=4, seed=5, num_pad_tokens=1)
  out = check(case, sm_scale=0.5, soft_cap=3.0)
  # The same pages as layer 1 of a two-layer cache, read in place under jit.
  k, v = (jnp.stack([jnp.zeros_like(jnp.asarray(x)), jnp.asarray(x)])
          for x in (case.k_pages, case.v_pages))
  fn = jax.jit(lambda q, k, v, tables, lens: xla.paged_decode_attention(
      q, k, v, layer=1, page_tables=tables, context_lens=lens, sm_scale=0.5, soft_cap=3.0))
  np.testing.assert_allclose(fn(case.q, k, v, case.page_tables, case.context_lens), out,
                             rtol=1e-6, atol=1e-6)


def test_agrees_with_the_reference_on_a_decode_batch():
  case = make_case(DECODE_SEQS, num_heads=8, num_kv_heads=2, head_dim=16, page_size=16,
                   seed=9, num_pad_tokens=3)
  args = (jnp.asarray(case.q), jnp.asarray(case.k_pages), jnp.asarray(case.v_pages))
  fast = xla.paged_decode_attention(*args, page_tables=case.page_tables,
                                    context_lens=case.context_lens)
  oracle = reference.ragged_paged_attention(*args, **case.kwargs())
  np.testing.assert_allclose(fast, oracle, rtol=1e-5, atol=1e-6)


def scheduled(query_lens):
  out = []
  for i, n in enumerate(query_lens):
    request = Request(f"r{i}", [1] * 8, SamplingParams(max_tokens=4))
    out.append(ScheduledSequence(f"r{i}", [7] * n, 8 - n, [1 + 2 * i, 2 + 2 * i], True,
                                 n > 1, request))
  return out


def test_build_marks_decode_only_batches_by_type():
  decode, _ = batch_lib.build(scheduled([1, 1, 1]), page_size=4)
  mixed, _ = batch_lib.build(scheduled([1, 3, 1]), page_size=4)
  assert isinstance(decode, batch_lib.DecodeStepBatch) and decode.decode_only
  assert type(mixed) is batch_lib.StepBatch and not mixed.decode_only
  # The flag survives jit as part of the pytree's type (so it is static).
  assert jax.jit(lambda b: jnp.asarray(b.decode_only))(decode)
  assert not jax.jit(lambda b: jnp.asarray(b.decode_only))(mixed)


def test_table_bucket_ladder():
  widths = [batch_lib.table_bucket(n) for n in range(1, 50)]
  assert all(w >= n for n, w in zip(range(1, 50), widths))
  assert sorted(set(widths)) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
  assert all(w <= max(1.5 * n, 2) for n, w in zip(range(1, 50), widths))
