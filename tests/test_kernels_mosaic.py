"""The Mosaic GPU decode kernel equals the reference (Mosaic GPU's interpreter on CPU).

Needs jax >= 0.11.2 (`plgpu.InterpretGPUParams`): CI runs this on Python 3.12 with the
newest jax and with 0.11.2, the H200 machine's version; on 3.11 (jax 0.10) it skips.
Cases: ragged contexts 1/3/17/513 (partial last pages) and a padding row in one batch,
pages in permuted order, GQA groups 1/4/8, fp32 and bf16, page sizes 16 and 64, a
4,096-token context split four ways; then lowering for an H200 without a GPU, which
enforces the layout rules the interpreter does not.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_config
from attention_cases import dense_attention, make_case, relative_error
from jax.experimental.pallas import mosaic_gpu as plgpu

from configs import scheduler as scheduler_lib
from kvpage import build
from kvpage.device.attention import reference
from kvpage.device.backends.pallas import attention as paged_attention
from kvpage.device.backends.pallas import mosaic_decode
from kvpage.request import SamplingParams
from models import llama

pytestmark = pytest.mark.skipif(not hasattr(plgpu, "InterpretGPUParams"),
                                reason=f"Mosaic GPU's interpreter needs jax >= 0.11.2, "
                                       f"this is {jax.__version__}")

SEQS = [(1, 1), (3, 1), (17, 1), (513, 1)]
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _check(case, dtype, **options):
  q, k, v = (jnp.asarray(x, dtype) for x in (case.q, case.k_pages, case.v_pages))
  kwargs = {name: jnp.asarray(x) for name, x in case.kwargs().items()}
  out = paged_attention.ragged_paged_attention(q, k, v, **kwargs, interpret=True,
                                               decode_kernel="mosaic", **options)
  expected = reference.ragged_paged_attention(q, k, v, **kwargs)
  out = np.asarray(out.astype(jnp.float32))
  real = case.num_real_tokens
  assert np.all(np.isfinite(out)) and not np.any(out[real:]), "padding rows must be zeros"
  expected = np.asarray(expected.astype(jnp.float32), np.float64)
  assert relative_error(out[:real], expected[:real]) < TOLERANCE[dtype]
  if dtype == jnp.float32:
    assert relative_error(out[:real], dense_attention(case, None, None)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_matches_the_reference_on_ragged_decode_batches(group, dtype):
  case = make_case(SEQS, num_heads=2 * group, num_kv_heads=2, head_dim=64, page_size=16,
                   seed=group, num_pad_tokens=1, num_pad_seqs=1)
  _check(case, dtype)


def test_pages_of_64_tokens_and_head_dim_128():
  case = make_case([(1, 1), (70, 1), (200, 1)], num_heads=8, num_kv_heads=2, head_dim=128,
                   page_size=64, seed=7)
  _check(case, jnp.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_long_context_split_four_ways(num_splits):
  case = make_case([(4096, 1), (5, 1)], num_heads=4, num_kv_heads=1, head_dim=64,
                   page_size=16, seed=11)
  q = jnp.asarray(case.q)
  out = mosaic_decode.paged_decode_attention(
      q, jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
      page_tables=jnp.asarray(case.page_tables), context_lens=jnp.asarray(case.context_lens),
      num_splits=num_splits, interpret=True)
  assert relative_error(np.asarray(out), dense_attention(case, None, None)) < 1e-5


def test_a_page_size_that_no_block_holds_whole_is_refused():
  with pytest.raises(ValueError, match="page size that divides 64"):
    mosaic_decode.block_tokens(48)


def _h200():
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                       platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                   abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize("page_size,num_splits", [(16, 1), (64, 1), (16, 4)])
def test_lowers_for_an_h200_without_a_gpu(page_size, num_splits):
  """The benchmark's shapes (32 query heads, 8 KV heads, head_dim 128, bf16): Mosaic
  GPU's layout inference and dialect lowering run here; only PTX is left for a GPU."""
  q = jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16)
  pages = jax.ShapeDtypeStruct((8, 100, page_size, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((4, 4096 // page_size), jnp.int32)
  lens = jax.ShapeDtypeStruct((4,), jnp.int32)

  def fn(q, k, v, page_tables, context_lens):
    return mosaic_decode.paged_decode_attention(q, k, v, page_tables=page_tables,
                                                context_lens=context_lens,
                                                num_splits=num_splits)

  with _h200():
    text = jax.jit(fn).trace(q, pages, pages, table, lens).lower(
        lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


def test_the_engine_lets_the_interpreter_move_its_own_scalars():
  """Mosaic GPU's interpreter moves scalars to the device inside its callbacks, which
  the serving path's transfer guard refuses (found by `benchmarks/kernel_gpu.py`'s
  generate run); on CPU with `mosaic` the guard logs instead, elsewhere it refuses."""
  model = tiny_config.get_config().model
  params = llama.random_init(model, seed=0)
  for impl, guard in (("mosaic", "log"), ("xla", "disallow")):
    model.attention_impl = impl
    engine = build.jax_engine(llama, model, params, scheduler_lib.get_scheduler_config(),
                              num_pages=16, page_size=16)
    assert engine.executor.guard == guard
  # The run that failed under "disallow": three prompts, one of 17 tokens (two pages).
  model.attention_impl = "mosaic"
  engine = build.jax_engine(llama, model, params, scheduler_lib.get_scheduler_config(),
                            num_pages=16, page_size=16)
  requests = engine.generate([list(range(1, 18)), [7, 3], [42]],
                             SamplingParams(max_tokens=6, ignore_eos=True))
  assert all(len(r.output_ids) == 6 for r in requests)
