"""The CPU attention kernels (`kvpage.device.backends.cpu.attention`) against the oracle and XLA.

The kernels read pages in place through the page table, so the cases scatter each
sequence's history into permuted pages (`attention_cases.make_case`) and read a layer
other than 0 of a whole cache. Decode: one to eight query heads per KV head, pages of
4 and 16 tokens, contexts ending mid-page, padding rows (limit 0), a soft cap.
Prefill: fresh prompts and chunks over a cached prefix, longer than a query block and
a key tile, beside decodes and padding tokens (whose rows it must leave zero), every
head size it is built for. On this project's machines a C++ compiler is present, so
the kernels must build; the tests say so rather than pass on the fallback.
"""

import itertools
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_config
from attention_cases import make_case

from kvpage.device import backends
from kvpage.device.attention import reference
from kvpage.device.backends.cpu import attention as cpu
from kvpage.device.backends.cpu import native as cpu_lib
from kvpage.device.backends.xla import attention as xla

ROOT = pathlib.Path(__file__).resolve().parents[1]


def whole_cache(pages: np.ndarray, layer: int, num_layers: int = 3) -> jax.Array:
  """`pages` as layer `layer` of a cache whose other layers hold other numbers."""
  others = np.random.default_rng(layer).standard_normal((num_layers, *pages.shape))
  return jnp.asarray(others.astype(np.float32)).at[layer].set(pages)


def test_the_kernel_builds_and_registers():
  assert cpu_lib.status() == "ready"


# Every head size the kernel is built for; pages shorter than, as long as and longer
# than the 16 keys it scores at a time.
@pytest.mark.parametrize("num_heads,num_kv_heads,page_size,head_dim", [
    (4, 4, 16, 32), (4, 2, 16, 64), (8, 1, 4, 128), (6, 3, 128, 32), (2, 1, 32, 16),
    (4, 2, 64, 256)])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
def test_decode_matches_the_oracle(num_heads, num_kv_heads, page_size, head_dim, soft_cap):
  seqs = [(1, 1), (page_size, 1), (page_size + 1, 1), (5 * page_size - 3, 1), (70, 1)]
  case = make_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   page_size=page_size, seed=num_heads + page_size, num_pad_seqs=2)
  num_seqs, num_real = len(case.context_lens), len(seqs)
  # Decode: sequence s's token is row s; the padding sequences' rows hold garbage.
  q = jnp.concatenate([jnp.asarray(case.q),
                       jnp.ones((num_seqs - num_real, num_heads, head_dim))])
  layer = 1
  out = cpu.paged_decode(q, whole_cache(case.k_pages, layer), whole_cache(case.v_pages, layer),
                         jnp.asarray(case.page_tables), jnp.asarray(case.context_lens),
                         layer=layer, sm_scale=0.3, soft_cap=soft_cap)
  expected = reference.ragged_paged_attention(
      q, jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
      page_tables=case.page_tables, context_lens=case.context_lens,
      query_start_loc=np.minimum(np.arange(num_seqs + 1), num_real).astype(np.int32),
      sm_scale=0.3, soft_cap=soft_cap)
  # fp32 sums in another order: up to ~1e-5 apart at head_dim 256, as for the prefill.
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=2e-5)
  assert not np.any(np.asarray(out)[num_real:])  # padding rows (limit 0) are zeros


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size", [
    (4, 2, 64, 16), (8, 1, 32, 4), (6, 3, 16, 8), (4, 4, 128, 16), (2, 1, 256, 32)])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("precision", [None, "high"])  # "high": on AMX where it runs
def test_prefill_matches_the_oracle(num_heads, num_kv_heads, head_dim, page_size, soft_cap,
                                    precision):
  # (context, new tokens): a decode, fresh prompts (one past a query block of 128 rows
  # and several key tiles of 64), chunks over a cached prefix, the shortest chunk.
  seqs = [(40, 1), (17, 17), (29, 11), (150, 70), (3, 2), (200, 200), (8, 1)]
  case = make_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   page_size=page_size, seed=head_dim + page_size, num_pad_tokens=3,
                   num_pad_seqs=1)
  layer = 1
  out = cpu.paged_prefill(jnp.asarray(case.q), whole_cache(case.k_pages, layer),
                          whole_cache(case.v_pages, layer), jnp.asarray(case.page_tables),
                          jnp.asarray(case.query_start_loc), jnp.asarray(case.context_lens),
                          layer=layer, sm_scale=0.3, soft_cap=soft_cap, precision=precision)
  expected = reference.ragged_paged_attention(
      jnp.asarray(case.q), jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
      page_tables=case.page_tables, context_lens=case.context_lens,
      query_start_loc=case.query_start_loc, sm_scale=0.3, soft_cap=soft_cap)
  starts = np.asarray(case.query_start_loc)
  chunk = np.zeros(len(case.q), bool)  # the tokens of sequences with 2+ new tokens
  for first, end in itertools.pairwise(starts):
    chunk[first:end] = end - first >= 2
  assert chunk.sum() == 17 + 11 + 70 + 2 + 200
  # bf16x3 scores are within ~1e-5 of |q||k| (`test_cpu_linear`), here ~1e-4 of a score.
  tolerance = 1e-3 if cpu_lib.bf16x3(precision) and head_dim % 32 == 0 else 1e-4
  np.testing.assert_allclose(np.asarray(out)[chunk], np.asarray(expected)[chunk],
                             rtol=tolerance, atol=tolerance / 5)
  assert not np.any(np.asarray(out)[~chunk])  # decodes and padding are left to others


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_the_cpu_paths_equal_the_xla_paths(decode_only):
  seqs = [(40, 1), (3, 1), (17, 1)] if decode_only else [(40, 1), (17, 17), (29, 11), (8, 1)]
  case = make_case(seqs, num_heads=4, num_kv_heads=2, head_dim=16, page_size=16, seed=7,
                   num_pad_tokens=3, num_pad_seqs=1)
  layer = 2
  k, v = whole_cache(case.k_pages, layer), whole_cache(case.v_pages, layer)
  q = jnp.asarray(case.q)
  entry = xla.paged_decode_attention if decode_only else xla.ragged_blocked_attention
  kwargs = dict(page_tables=case.page_tables, context_lens=case.context_lens, layer=layer)
  if not decode_only:
    kwargs["query_start_loc"] = case.query_start_loc
  kernels = backends.cpu.row_kernels(q, k, precision=None)
  assert kernels.decode is not None and kernels.prompt_chunks is not None
  ours = jax.jit(lambda q, k, v: entry(q, k, v, **kwargs, kernels=kernels))(q, k, v)
  theirs = entry(q, k, v, **kwargs)
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_shapes_the_kernel_does_not_take_stay_on_xla():
  assert cpu.runs("float32", group=2, head_dim=64)
  assert not cpu.runs("bfloat16", group=2, head_dim=64)
  assert not cpu.runs("float32", group=2, head_dim=48)
  assert not cpu.runs("float32", group=32, head_dim=64)
  with pytest.raises(ValueError, match="does not run here"):
    cpu.paged_decode(jnp.zeros((1, 2, 8), jnp.bfloat16), *[jnp.zeros((1, 1, 2, 16, 8),
                     jnp.bfloat16)] * 2, jnp.zeros((1, 1), jnp.int32),
                     jnp.ones(1, jnp.int32), layer=0, sm_scale=1.0)
  assert cpu.prefill_runs("float32", head_dim=64)
  assert not cpu.prefill_runs("bfloat16", head_dim=64)
  assert not cpu.prefill_runs("float32", head_dim=48)
  with pytest.raises(ValueError, match="does not run here"):
    cpu.paged_prefill(jnp.zeros((4, 2, 48)), *[jnp.zeros((1, 1, 2, 16, 48))] * 2,
                      jnp.zeros((1, 1), jnp.int32), jnp.asarray([0, 4], jnp.int32),
                      jnp.asarray([4], jnp.int32), layer=0, sm_scale=1.0)


def test_the_engine_generates_the_same_tokens_with_either_path():
  prompts = [list(range(1, 30)), [7, 3], [42] * 9]

  def tokens(impl):
    engine = tiny_config.mixed_step_engine(attention_impl=impl)
    assert engine.executor.traits.decode_reads_longest == (impl == "xla")
    return tiny_config.greedy_tokens(engine, prompts, 6)

  assert tokens("cpu") == tokens("xla")


def test_loading_the_kernel_keeps_subnormals():
  """A library linked with -ffast-math switches the loading thread to flush subnormals
  to zero, which silently changes every float computation after it (and hypothesis
  refuses to run). Loaded in a fresh process, the kernel must leave them alone."""
  code = ("import numpy as np; from kvpage.device.backends.cpu import native; "
          "assert native.status() == 'ready', native.status(); "
          "print(float((np.array([1e-39], np.float32) * np.float32(1.0))[0]))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, check=True)
  assert float(result.stdout) > 0.0
