"""The oracle and the XLA query-block path equal dense causal attention on unpaged sequences.

Input checks are in `test_attention_validation.py`, the decode-only XLA path in
`test_decode_fast_path.py`, the kernels in `test_kernels.py`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import dense_attention, make_case, relative_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpage.device.attention import reference
from kvpage.device.backends.xla import attention as xla

HEAD_DIM = 16


def run(case, dtype=jnp.float32, **kwargs):
  return np.asarray(reference.ragged_paged_attention(
      jnp.asarray(case.q, dtype), jnp.asarray(case.k_pages, dtype),
      jnp.asarray(case.v_pages, dtype), **case.kwargs(), **kwargs).astype(jnp.float32))


def check(case, dtype=jnp.float32, tolerance=1e-5, **kwargs):
  out = run(case, dtype, **kwargs)
  assert np.all(np.isfinite(out)), "padding produced NaN/inf"
  expected = dense_attention(case, kwargs.get("sm_scale"), kwargs.get("soft_cap"))
  assert relative_error(out[:case.num_real_tokens], expected) < tolerance
  # Padding rows come out as exact zeros.
  assert not np.any(out[case.num_real_tokens:])


seq_lengths = st.sampled_from([1, 2, 3, 15, 16, 17, 31, 33, 64, 100])


@st.composite
def ragged_batches(draw):
  """Mixed batches: each sequence decodes (1 new token), prefills whole, or chunks."""
  seqs = []
  for _ in range(draw(st.integers(1, 5))):
    ctx = draw(seq_lengths)
    kind = draw(st.sampled_from(["decode", "prefill", "chunk"]))
    qlen = {"decode": 1, "prefill": ctx, "chunk": draw(st.integers(1, ctx))}[kind]
    seqs.append((ctx, qlen))
  return seqs


# Every example compiles its own shapes, so the example counts are what the suite's time
# allows (the named batches below pin the edge cases; each run draws new random ones).
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=ragged_batches(), group=st.sampled_from([1, 2, 4, 8]),
       num_kv_heads=st.sampled_from([1, 2]), page_size=st.sampled_from([1, 4, 16]),
       num_pad_tokens=st.integers(0, 3), num_pad_seqs=st.integers(0, 2),
       tokens_per_tile=st.sampled_from([16, 64, 256]), seed=st.integers(0, 2**16))
def test_random_ragged_batches_match_dense(seqs, group, num_kv_heads, page_size,
                                           num_pad_tokens, num_pad_seqs, tokens_per_tile,
                                           seed):
  case = make_case(seqs, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                   head_dim=HEAD_DIM, page_size=page_size, seed=seed,
                   num_pad_tokens=num_pad_tokens, num_pad_seqs=num_pad_seqs)
  check(case, tokens_per_tile=tokens_per_tile)


@pytest.mark.parametrize("name,seqs", [
    ("decode_only", [(1, 1), (3, 1), (16, 1), (17, 1), (513, 1)]),
    ("prefill_only", [(1, 1), (3, 3), (17, 17), (513, 513)]),
    ("mixed", [(513, 1), (17, 17), (40, 7), (3, 1), (100, 37)]),
    ("chunk_not_page_aligned", [(29, 11), (21, 5)]),
])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_named_batches(name, seqs, group):
  case = make_case(seqs, num_heads=2 * group, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16,
                   seed=len(name) + group, num_pad_tokens=2, num_pad_seqs=1)
  check(case)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(dtype):
  case = make_case([(513, 1), (17, 17), (40, 7)], num_heads=8, num_kv_heads=2,
                   head_dim=HEAD_DIM, page_size=16, seed=3)
  # Compare with the dense oracle on the inputs as rounded to the half-precision dtype.
  for array in (case.q, case.k_pages, case.v_pages, *case.keys, *case.values):
    array[...] = np.asarray(jnp.asarray(array, dtype).astype(jnp.float32))
  check(case, dtype=dtype, tolerance=2e-2)


def test_scale_and_soft_cap():
  case = make_case([(33, 5), (9, 1)], num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM,
                   page_size=4, seed=7)
  check(case, sm_scale=0.5, soft_cap=3.0)


def test_permuting_pages_does_not_change_the_result():
  case = make_case([(40, 6), (20, 1)], num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM,
                   page_size=4, seed=11)
  before = run(case)
  permutation = np.concatenate([[0], np.random.default_rng(0).permutation(
      np.arange(1, case.k_pages.shape[1]))])
  inverse = np.argsort(permutation)
  case.k_pages = case.k_pages[:, permutation]
  case.v_pages = case.v_pages[:, permutation]
  case.page_tables = inverse[case.page_tables].astype(np.int32)
  np.testing.assert_allclose(run(case), before, rtol=1e-6, atol=1e-6)


# The query-block path (`ragged_blocked_attention`), the model's fast XLA path for
# mixed steps, against the same dense oracle.
def check_blocked(case, tolerance=1e-5, **kwargs):
  # Under jit, as the model runs it: one compilation, not one per operation.
  fn = jax.jit(functools.partial(xla.ragged_blocked_attention, **kwargs))
  out = np.asarray(fn(jnp.asarray(case.q), jnp.asarray(case.k_pages),
                      jnp.asarray(case.v_pages), **case.kwargs()))
  expected = dense_attention(case, kwargs.get("sm_scale"), kwargs.get("soft_cap"))
  assert relative_error(out[:case.num_real_tokens], expected) < tolerance
  assert not np.any(out[case.num_real_tokens:])
  return out


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=ragged_batches(), group=st.sampled_from([1, 2, 4]),
       page_size=st.sampled_from([1, 4, 16]), num_pad_tokens=st.integers(0, 3),
       num_pad_seqs=st.integers(0, 2),
       query_block=st.sampled_from([1, 2, 4, 16, xla.PREFILL_QUERY_BLOCK]),
       tokens_per_tile=st.sampled_from([16, 64]), seed=st.integers(0, 2**16))
def test_query_blocks_match_dense(seqs, group, page_size, num_pad_tokens, num_pad_seqs,
                                  query_block, tokens_per_tile, seed):
  case = make_case(seqs, num_heads=2 * group, num_kv_heads=2, head_dim=HEAD_DIM,
                   page_size=page_size, seed=seed, num_pad_tokens=num_pad_tokens,
                   num_pad_seqs=num_pad_seqs)
  check_blocked(case, query_block=query_block, tokens_per_tile=tokens_per_tile)


@pytest.mark.parametrize("query_block", [1, 16, xla.PREFILL_QUERY_BLOCK])
def test_query_blocks_on_named_batches_scale_soft_cap_and_whole_cache(query_block):
  case = make_case([(513, 1), (17, 17), (40, 7), (3, 1), (100, 37), (29, 11)], num_heads=4,
                   num_kv_heads=2, head_dim=HEAD_DIM, page_size=16, seed=query_block,
                   num_pad_tokens=5, num_pad_seqs=1)
  out = check_blocked(case, query_block=query_block, sm_scale=0.5, soft_cap=3.0)
  # The same pages as layer 1 of a two-layer cache, read in place under jit.
  k, v = (jnp.stack([jnp.zeros_like(jnp.asarray(x)), jnp.asarray(x)])
          for x in (case.k_pages, case.v_pages))
  fn = jax.jit(lambda q, k, v, tables, lens, starts: xla.ragged_blocked_attention(
      q, k, v, layer=1, page_tables=tables, context_lens=lens, query_start_loc=starts,
      sm_scale=0.5, soft_cap=3.0, query_block=query_block))
  np.testing.assert_allclose(
      fn(case.q, k, v, case.page_tables, case.context_lens, case.query_start_loc), out,
      rtol=1e-5, atol=1e-6)


def test_multi_token_only_schedules_blocks_for_prompt_chunks_alone():
  # Sequences of 1 (a decode), 5 and 1 new tokens, then a padding sequence.
  starts, lens = jnp.array([0, 1, 6, 7, 7]), jnp.array([9, 12, 4, 0])
  schedule, rows = xla.query_blocks(starts, lens, 8, 4, multi_token_only=True)
  used = np.asarray(schedule)[np.asarray(schedule)[:, 2] > 0]
  # (seq, first token, real tokens, first position, context): two blocks of sequence 1.
  np.testing.assert_array_equal(used, [[1, 1, 4, 7, 12], [1, 5, 1, 11, 12]])
  np.testing.assert_array_equal(rows, [-1, 0, 1, 2, 3, 4, -1, -1])
