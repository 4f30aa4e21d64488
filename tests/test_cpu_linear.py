"""The CPU linear kernel (`kvpage.device.cpu.linear`): products, the choice, the model.

The kernel computes `x @ w` for products of few rows on kvpage's worker threads. The
tests hold it to float64 products over ragged shapes (rows not a multiple of its 8-row
blocks, inner sizes from 1), check that `dot_general` takes exactly the products it
should and leaves the rest to XLA unchanged, that a model on it generates the tokens
of the same model on XLA, and that callers on several threads at once (the helpers
serve one job at a time; the others run on their own thread) all get their products.
"""

import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_config

from kvpage import batch as batch_lib
from kvpage.device import cache as paged_cache
from kvpage.device import cpu
from kvpage.device.cpu import linear
from models import llama

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler here")


def _operands(rows: int, inner: int, columns: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((rows, inner)).astype(np.float32),
          rng.standard_normal((inner, columns)).astype(np.float32))


def test_the_kernels_build():
  assert cpu.status() == "ready"


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64, 100, 128])
@pytest.mark.parametrize("inner,columns", [(1, 32), (17, 96), (256, 512)])
def test_products_match_float64(rows, inner, columns):
  x, w = _operands(rows, inner, columns, seed=rows + inner)
  got = np.asarray(jax.jit(linear.linear)(jnp.asarray(x), jnp.asarray(w)))
  want = x.astype(np.float64) @ w.astype(np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(inner))


def test_leading_axes_are_rows():
  x, w = _operands(24, 64, 64)
  x3 = jnp.asarray(x.reshape(2, 12, 64))
  got = jax.jit(linear.linear)(x3, jnp.asarray(w))
  assert got.shape == (2, 12, 64)
  np.testing.assert_allclose(np.asarray(got).reshape(24, 64), x @ w, rtol=1e-5, atol=1e-4)


def test_runs_only_where_it_should():
  assert linear.runs(1, 32, jnp.float32)
  assert linear.runs(linear.MAX_ROWS, 512, jnp.float32)
  assert not linear.runs(linear.MAX_ROWS + 1, 512, jnp.float32)  # XLA is faster there
  assert not linear.runs(64, 48, jnp.float32)  # not whole panels of 32 columns
  assert not linear.runs(64, 512, jnp.bfloat16)
  assert not linear.runs(0, 512, jnp.float32)
  with pytest.raises(ValueError, match="does not run here"):
    linear.linear(jnp.ones((4, 8)), jnp.ones((8, 48)))


def _custom_calls(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().as_text().count("kvpage_linear")


@pytest.mark.parametrize("rows,columns,takes", [
    (64, 256, True), (linear.MAX_ROWS + 8, 256, False), (64, 40, False)])
def test_dot_general_takes_what_runs_and_passes_on_the_rest(rows, columns, takes):
  x, w = _operands(rows, 32, columns)
  dims = (((1,), (0,)), ((), ()))
  args = (jnp.asarray(x), jnp.asarray(w))
  assert (_custom_calls(lambda a, b: linear.dot_general(a, b, dims), *args) > 0) == takes
  got = jax.jit(lambda a, b: linear.dot_general(a, b, dims))(*args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(jax.lax.dot_general(*args, dims)),
                             rtol=1e-5, atol=1e-5)


def test_dot_general_leaves_other_contractions_to_xla():
  a, b = jnp.ones((4, 8, 16)), jnp.ones((4, 16, 32))
  batched = (((2,), (1,)), ((0,), (0,)))  # a batch axis: not a dense layer's product
  assert _custom_calls(lambda p, q: linear.dot_general(p, q, batched), a, b) == 0
  np.testing.assert_array_equal(np.asarray(linear.dot_general(a, b, batched)),
                                np.asarray(jax.lax.dot_general(a, b, batched)))


def test_a_model_on_the_kernel_generates_the_tokens_of_xla():
  prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5], list(range(1, 30))]
  on_kernel, on_xla = (tiny_config.greedy_tokens(tiny_config.mixed_step_engine(
      linear_impl=impl), prompts, 8) for impl in ("cpu", "xla"))
  assert on_kernel == on_xla


def test_the_decode_step_runs_its_products_on_the_kernel():
  model = tiny_config.get_config().model
  model.linear_impl = "cpu"
  params = llama.random_init(model, seed=1)
  batch = batch_lib.example_batch(num_tokens=8, num_seqs=8, max_pages_per_seq=2,
                                  decode_only=True)
  cache = paged_cache.init(model, num_pages=17, page_size=4)
  text = jax.jit(lambda p, c, b: llama.forward(p, c, b, config=model)).lower(
      params, cache, batch).compile().as_text()
  # q, k, v, o, gate, up, down in every layer, and the LM head.
  assert text.count('custom_call_target="kvpage_linear"') == 7 * model.num_layers + 1


def test_unknown_linear_impl_is_refused():
  model = tiny_config.get_config().model
  model.linear_impl = "blas"
  with pytest.raises(ValueError, match="linear_impl 'blas'"):
    llama.random_init(model, seed=0)


def test_callers_on_several_threads_all_get_their_products():
  fn = jax.jit(linear.linear)
  cases = [_operands(64, 256, 256, seed=seed) for seed in range(4)]
  want = [x @ w for x, w in cases]
  errors = []

  def work(index):
    x, w = map(jnp.asarray, cases[index])
    for _ in range(50):
      got = np.asarray(fn(x, w))
      if not np.allclose(got, want[index], rtol=1e-5, atol=1e-3):
        errors.append(index)
        return

  threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(timeout=120)
  assert not any(thread.is_alive() for thread in threads)
  assert errors == []
