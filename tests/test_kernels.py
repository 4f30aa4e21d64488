"""The Pallas kernels equal the reference attention (interpret mode on CPU).

Cases come from `attention_cases` (ragged batches, permuted pages, padding tokens and
padded sequences, lengths 1/3/17/513, partial last pages, GQA groups 1/4/8), the same
generator the reference is tested with; each kernel is compared with
`reference.ragged_paged_attention` and, in fp32, with the float64 dense oracle.
Head dims and head counts are small: the interpreter is slow, the logic is the same.
A last test lowers both kernels for CUDA, which checks the Triton lowering on CPU.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import dense_attention, make_case, relative_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpage.device.attention import reference
from kvpage.device.backends.pallas import attention as paged_attention
from kvpage.device.backends.pallas import decode as decode_attention
from kvpage.device.backends.pallas import ragged as ragged_attention

HEAD_DIM = 16
FP32_TOLERANCE = 1e-5
HALF_TOLERANCE = 2e-2


def arrays(case, dtype=jnp.float32):
  q, k, v = (jnp.asarray(x, dtype) for x in (case.q, case.k_pages, case.v_pages))
  return q, k, v, {name: jnp.asarray(x) for name, x in case.kwargs().items()}


def check_against_reference(out, case, dtype=jnp.float32, tolerance=FP32_TOLERANCE, **options):
  """Kernel output == reference (and, in fp32, == dense); padding rows exact zeros."""
  q, k, v, kwargs = arrays(case, dtype)
  expected = reference.ragged_paged_attention(q, k, v, **kwargs, **options)
  out = np.asarray(jnp.asarray(out).astype(jnp.float32))
  assert out.shape == case.q.shape
  assert np.all(np.isfinite(out)), "NaN/inf in the kernel output"
  real = case.num_real_tokens
  expected = np.asarray(expected.astype(jnp.float32), np.float64)
  assert relative_error(out[:real], expected[:real]) < tolerance
  if dtype == jnp.float32:
    assert relative_error(out[:real], dense_attention(
        case, options.get("sm_scale"), options.get("soft_cap"))) < tolerance
  assert not np.any(out[real:]), "padding rows must be zeros"


def run_entry(case, dtype=jnp.float32, **options):
  q, k, v, kwargs = arrays(case, dtype)
  return paged_attention.ragged_paged_attention(q, k, v, **kwargs, **options, interpret=True)


def run_decode(case, dtype=jnp.float32, **options):
  """The decode kernel directly; every sequence of `case` must have one new token."""
  q, k, v, kwargs = arrays(case, dtype)
  num_real = case.num_real_tokens
  q_seqs = jnp.zeros((case.page_tables.shape[0], *q.shape[1:]), dtype).at[:num_real].set(
      q[:num_real])
  out = decode_attention.paged_decode_attention(
      q_seqs, k, v, page_tables=kwargs["page_tables"], context_lens=kwargs["context_lens"],
      interpret=True, **options)
  return jnp.zeros_like(q).at[:num_real].set(out[:num_real]), out[num_real:]


DECODE_SEQS = [(1, 1), (3, 1), (16, 1), (17, 1), (513, 1)]
MIXED_SEQS = [(513, 1), (17, 17), (40, 7), (3, 1), (29, 11)]


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_kernel_matches_reference(group, num_splits):
  case = make_case(DECODE_SEQS, num_heads=2 * group, num_kv_heads=2, head_dim=HEAD_DIM,
                   page_size=16, seed=group, num_pad_seqs=2)
  out, padded_seqs = run_decode(case, num_splits=num_splits)
  check_against_reference(out, case)
  assert not np.any(np.asarray(padded_seqs)), "length-0 sequences must give zeros"


@pytest.mark.parametrize("block_q", [None, 4])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_ragged_kernel_matches_reference(group, block_q):
  case = make_case(MIXED_SEQS, num_heads=2 * group, num_kv_heads=2, head_dim=HEAD_DIM,
                   page_size=16, seed=10 + group, num_pad_tokens=3, num_pad_seqs=1)
  q, k, v, kwargs = arrays(case)
  out = ragged_attention.ragged_mixed_attention(q, k, v, **kwargs, block_q=block_q,
                                                interpret=True)
  check_against_reference(out, case)


def test_ragged_kernel_prefills_a_long_prompt():
  case = make_case([(513, 513)], num_heads=4, num_kv_heads=1, head_dim=HEAD_DIM,
                   page_size=16, seed=5, num_pad_tokens=1)
  check_against_reference(run_entry(case), case)


seq_lengths = st.sampled_from([1, 2, 3, 15, 16, 17, 33, 64])


@st.composite
def ragged_batches(draw):
  """Decode-only batches (the decode kernel) or mixed ones (the ragged kernel)."""
  decode_only = draw(st.booleans())
  seqs = []
  for _ in range(draw(st.integers(1, 4))):
    ctx = draw(seq_lengths)
    seqs.append((ctx, 1 if decode_only else draw(st.integers(1, ctx))))
  return seqs


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=ragged_batches(), group=st.sampled_from([1, 2, 4, 8]),
       num_kv_heads=st.sampled_from([1, 2]), page_size=st.sampled_from([1, 4, 16]),
       num_pad_tokens=st.integers(0, 2), num_pad_seqs=st.integers(0, 1),
       seed=st.integers(0, 2**16))
def test_random_ragged_batches_match_reference(seqs, group, num_kv_heads, page_size,
                                               num_pad_tokens, num_pad_seqs, seed):
  case = make_case(seqs, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                   head_dim=HEAD_DIM, page_size=page_size, seed=seed,
                   num_pad_tokens=num_pad_tokens, num_pad_seqs=num_pad_seqs)
  check_against_reference(run_entry(case), case)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("seqs", [DECODE_SEQS[2:], MIXED_SEQS[:3]], ids=["decode", "mixed"])
def test_half_precision(dtype, seqs):
  case = make_case(seqs, num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16,
                   seed=3, num_pad_tokens=1)
  check_against_reference(run_entry(case, dtype), case, dtype, tolerance=HALF_TOLERANCE)


@pytest.mark.parametrize("seqs", [[(33, 1), (9, 1)], [(33, 5), (9, 1)]],
                         ids=["decode", "mixed"])
def test_scale_and_soft_cap(seqs):
  case = make_case(seqs, num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, page_size=4, seed=7)
  options = dict(sm_scale=0.5, soft_cap=3.0)
  check_against_reference(run_entry(case, **options), case, **options)


@pytest.mark.parametrize("seqs", [[(40, 1), (20, 1)], [(40, 6), (20, 1)]],
                         ids=["decode", "mixed"])
def test_permuting_pages_does_not_change_the_result(seqs):
  case = make_case(seqs, num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, page_size=4, seed=11)
  before = np.asarray(run_entry(case))
  permutation = np.concatenate([[0], np.random.default_rng(0).permutation(
      np.arange(1, case.k_pages.shape[1]))])
  case.k_pages, case.v_pages = case.k_pages[:, permutation], case.v_pages[:, permutation]
  case.page_tables = np.argsort(permutation)[case.page_tables].astype(np.int32)
  np.testing.assert_allclose(np.asarray(run_entry(case)), before, rtol=1e-6, atol=1e-6)


def test_one_jitted_step_serves_decode_and_mixed_batches():
  """Under jit the lengths are traced: one trace dispatches both ways via lax.cond."""
  traces = []

  @jax.jit
  def step(q, k, v, page_tables, context_lens, query_start_loc):
    traces.append(1)
    return paged_attention.ragged_paged_attention(
        q, k, v, page_tables=page_tables, context_lens=context_lens,
        query_start_loc=query_start_loc, interpret=True)

  # Same shapes (6 token rows, 3 sequences, 4 table columns), different kinds of batch.
  for seqs, pads in (([(40, 1), (7, 1), (19, 1)], 3), ([(40, 3), (7, 2), (19, 1)], 0)):
    case = make_case(seqs, num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16,
                     seed=2, num_pad_tokens=pads, extra_pages=3)
    case.page_tables = np.pad(case.page_tables, ((0, 0), (0, 4 - case.page_tables.shape[1])))
    q, k, v, kwargs = arrays(case)
    check_against_reference(step(q, k, v, *kwargs.values()), case)
  assert len(traces) == 1


def test_gpu_tiling_rules_are_enforced_outside_interpret_mode():
  case = make_case([(9, 1)], num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, page_size=3,
                   seed=0)
  q, k, v, kwargs = arrays(case)
  with pytest.raises(ValueError, match="power-of-two page_size"):
    paged_attention.ragged_paged_attention(q, k, v, **kwargs)


# GPUs to lower for without one: (device kind as CUDA reports it, streaming multiprocessors).
GPU_TARGETS = {"h100": ("NVIDIA H100 80GB HBM3", 132), "h200": ("NVIDIA H200", 132)}


def gpu_target(name: str):
  """Lowering for CUDA on a machine without a GPU: since jax 0.11 the Triton lowering
  reads the target GPU from the current abstract mesh (JAX's own deviceless AOT
  tests do this); older releases accept the same context and read nothing from it."""
  device_kind, num_cores = GPU_TARGETS[name]
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores,
                                       platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                   abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize("target", sorted(GPU_TARGETS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_kernels_lower_to_triton_for_cuda(kernel, dtype, target):
  """Cross-lowering on CPU runs the whole Pallas->Triton IR lowering for the GPU.

  Shapes are the benchmark's (32 query heads, 8 KV heads, head_dim 128, page size 16);
  only Triton's own compile to PTX is left for a GPU machine (benchmarks/kernel_gpu.py).
  """
  num_seqs, num_tokens = 4, 4 if kernel == "decode" else 37
  q = jax.ShapeDtypeStruct((num_tokens, 32, 128), dtype)
  pages = jax.ShapeDtypeStruct((8, 100, 16, 128), dtype)
  table = jax.ShapeDtypeStruct((num_seqs, 40), jnp.int32)
  lens = jax.ShapeDtypeStruct((num_seqs,), jnp.int32)
  if kernel == "decode":
    fn = lambda q, k, v, bt, cl: decode_attention.paged_decode_attention(
        q, k, v, page_tables=bt, context_lens=cl)
    operands = (q, pages, pages, table, lens)
  else:
    fn = lambda q, k, v, bt, cl, qsl: ragged_attention.ragged_mixed_attention(
        q, k, v, page_tables=bt, context_lens=cl, query_start_loc=qsl)
    operands = (q, pages, pages, table, lens, jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32))
  with gpu_target(target):
    text = jax.jit(fn).trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 1
