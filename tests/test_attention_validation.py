"""The attention input contract: static checks (shapes, dtypes) and dynamic ones (values).

`validate_static` reads only shapes and dtypes, so it runs everywhere, under jit too;
`validate_dynamic` reads values, so it needs concrete arrays and says so when handed
tracers. The oracle runs both when its inputs are concrete.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import make_case

from kvpage.device.attention import reference
from kvpage.device.backends.xla import attention as xla

HEAD_DIM = 16


@pytest.fixture
def case():
  # Two sequences (a chunk of 2 and a decode) over pages of 4, one padding token and one
  # padded sequence: the edge cases a valid batch may hold.
  return make_case([(20, 2), (9, 1)], num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM,
                   page_size=4, seed=0, num_pad_tokens=1, num_pad_seqs=1)


def operands(case):
  return (jnp.asarray(case.q), jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
          case.page_tables, case.context_lens, case.query_start_loc)


def test_a_valid_batch_passes_both_checks(case):
  reference.validate_static(*operands(case))
  reference.validate_dynamic(*operands(case))


def test_bad_shapes_and_dtypes_raise_value_errors(case):
  q, k, v = (jnp.asarray(x) for x in (case.q, case.k_pages, case.v_pages))
  kwargs = case.kwargs()
  with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
    reference.ragged_paged_attention(q[:, :3], k, v, **kwargs)
  with pytest.raises(ValueError, match="mismatched dtypes"):
    reference.ragged_paged_attention(q.astype(jnp.bfloat16), k, v, **kwargs)
  with pytest.raises(ValueError, match="head_dim"):
    reference.ragged_paged_attention(q[..., :8], k, v, **kwargs)
  with pytest.raises(ValueError, match="query_start_loc"):
    reference.ragged_paged_attention(q, k, v, **{**kwargs, "query_start_loc": np.array(
        [0], np.int32)})
  with pytest.raises(ValueError, match="context_lens must hold integers"):
    reference.ragged_paged_attention(q, k, v, **{**kwargs, "context_lens": kwargs[
        "context_lens"].astype(np.float32)})


def test_the_static_check_runs_under_jit(case):
  q, k, v, tables, lens, starts = operands(case)
  paths = {
      "reference": lambda q, k, v, t, n, s: reference.ragged_paged_attention(
          q, k, v, page_tables=t, context_lens=n, query_start_loc=s),
      "xla blocked": lambda q, k, v, t, n, s: xla.ragged_blocked_attention(
          q, k[None], v[None], layer=0, page_tables=t, context_lens=n, query_start_loc=s),
      "xla decode": lambda q, k, v, t, n, s: xla.paged_decode_attention(
          q, k[None], v[None], layer=0, page_tables=t, context_lens=n),
  }
  for path in paths.values():
    with pytest.raises(ValueError, match="mismatched dtypes"):
      jax.jit(path)(q.astype(jnp.bfloat16), k, v, tables, lens, starts)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
      jax.jit(path)(q[:, :3], k, v, tables, lens, starts)
    jax.jit(path).trace(q, k, v, tables, lens, starts)  # while a valid batch traces


@pytest.mark.parametrize("field,value,message", [
    ("query_start_loc", [1, 3, 4, 4], "must start at 0"),
    ("query_start_loc", [0, 3, 2, 2], "must not decrease"),
    ("query_start_loc", [0, 3, 5, 5], "ends at 5 > num_tokens=4"),
    ("context_lens", [20, 0, 0], "sequence 1: context length 0 < its 1 new tokens"),
    ("context_lens", [40, 9, 0], "page table too narrow"),
])
def test_each_dynamic_check_raises_a_clear_value_error(case, field, value, message):
  setattr(case, field, np.array(value, np.int32))
  with pytest.raises(ValueError, match=message):
    reference.validate_dynamic(*operands(case))
  with pytest.raises(ValueError, match=message):  # the oracle runs it on concrete inputs
    reference.ragged_paged_attention(*operands(case)[:3], **case.kwargs())


@pytest.mark.parametrize("page_id", [-1, "num_pages"])
def test_page_ids_outside_the_pool_raise(case, page_id):
  num_pages = case.k_pages.shape[1]
  case.page_tables[1, -1] = num_pages if page_id == "num_pages" else page_id
  with pytest.raises(ValueError, match=rf"page ids must lie in \[0, {num_pages}\)"):
    reference.validate_dynamic(*operands(case))


def test_the_dynamic_check_refuses_tracers_instead_of_skipping(case):
  q, k, v, tables, lens, starts = operands(case)
  check = lambda lens: reference.validate_dynamic(q, k, v, tables, lens, starts)
  with pytest.raises(TypeError, match="needs concrete arrays"):
    jax.jit(check)(lens)
