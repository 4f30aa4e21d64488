"""The CPU linear kernels (`kvpage.device.backends.cpu.linear`): products, the choice, the model.

`linear.cc` computes `x @ w` in fp32 for products of few rows on kvpage's worker
threads; `linear_amx.cc` computes products of more rows on AMX in three bf16 passes,
at `Precision.HIGH`. The tests hold the first to float64 products over ragged shapes
(rows not a multiple of its 8-row blocks, inner sizes from 1) and the second to its
error bound (rows, inner sizes and columns not multiples of its tiles); check that
`project` and `swiglu` take exactly the products they should and leaves the rest to XLA
unchanged (several products of one input in one call, SwiGLU's two with their
activation); that a model on the kernels generates the tokens of the same model on XLA;
and that callers on several threads at once (the helpers serve one job at a time; the
others run on their own thread) all get their products.
"""

import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_config

from kvpage import batch as batch_lib
from kvpage.device import cache as paged_cache
from kvpage.device.backends import xla
from kvpage.device.backends.cpu import linear
from kvpage.device.backends.cpu import native as cpu
from models import llama


def kernel_linear(x: jax.Array, w: jax.Array, precision=None) -> jax.Array:
  """`x @ w` on the kernel `linear.target` names; fails the test where none would run."""
  rows = math.prod(x.shape[:-1])
  name = linear.target(rows, w.shape[1], w.dtype, precision)
  if name is None:
    raise ValueError(f"no kernel runs {rows} x {w.shape} at precision {precision}")
  return linear.project(x, [w], precision)[0]


def _operands(rows: int, inner: int, columns: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((rows, inner)).astype(np.float32),
          rng.standard_normal((inner, columns)).astype(np.float32))


def test_the_kernels_build():
  assert cpu.status() == "ready"


def _need_amx():
  if not cpu.amx():
    pytest.skip("no AMX on this CPU (or the OS does not grant it)")


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64, 100, 128])
@pytest.mark.parametrize("inner,columns", [(1, 32), (17, 96), (256, 512)])
def test_products_match_float64(rows, inner, columns):
  x, w = _operands(rows, inner, columns, seed=rows + inner)
  got = np.asarray(jax.jit(kernel_linear)(jnp.asarray(x), jnp.asarray(w)))
  want = x.astype(np.float64) @ w.astype(np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(inner))


def test_leading_axes_are_rows():
  x, w = _operands(24, 64, 64)
  x3 = jnp.asarray(x.reshape(2, 12, 64))
  got = jax.jit(kernel_linear)(x3, jnp.asarray(w))
  assert got.shape == (2, 12, 64)
  np.testing.assert_allclose(np.asarray(got).reshape(24, 64), x @ w, rtol=1e-5, atol=1e-4)


def test_runs_only_where_it_should():
  assert linear.runs(1, 32, jnp.float32)
  assert linear.runs(linear.MAX_ROWS, 512, jnp.float32)
  assert not linear.runs(linear.MAX_ROWS + 1, 512, jnp.float32)  # XLA is faster there
  assert not linear.runs(64, 48, jnp.float32)  # not whole panels of 32 columns
  assert not linear.runs(64, 512, jnp.bfloat16)
  assert not linear.runs(0, 512, jnp.float32)
  assert linear.target(4, 48, jnp.float32) is None  # project leaves it to XLA


def _custom_calls(fn, *args, target: str = "kvpage_linear") -> int:
  text = jax.jit(fn).lower(*args).compile().as_text()
  return text.count(f'custom_call_target="{target}"')


@pytest.mark.parametrize("rows,columns,calls", [
    (64, [256, 128, 128], 1), (linear.MAX_ROWS + 8, [256], 0), (64, [64, 40], 0)])
def test_project_takes_what_runs_in_one_call_and_passes_on_the_rest(rows, columns, calls):
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((rows, 32)), jnp.float32)
  weights = [jnp.asarray(rng.standard_normal((32, n)), jnp.float32) for n in columns]
  assert _custom_calls(lambda a, *ws: linear.project(a, list(ws)), x, *weights) == calls
  got = jax.jit(lambda a, *ws: linear.project(a, list(ws)))(x, *weights)
  for out, w in zip(got, weights, strict=True):
    np.testing.assert_allclose(np.asarray(out), np.asarray(x @ w), rtol=1e-5, atol=1e-5)


def _swiglu_float64(x, gate, up):
  g, u = x.astype(np.float64) @ gate.astype(np.float64), x.astype(np.float64) @ up
  return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize("rows,precision,target", [
    (1, None, "kvpage_swiglu"), (37, None, "kvpage_swiglu"),
    (linear.MAX_ROWS, "high", "kvpage_swiglu"), (200, "high", "kvpage_swiglu_bf16x3"),
    (200, None, None)])
def test_swiglu_matches_float64(rows, precision, target):
  if target == "kvpage_swiglu_bf16x3":
    _need_amx()
  x, gate = _operands(rows, 64, 96, seed=rows)
  up = _operands(1, 64, 96, seed=rows + 1)[1]
  args = tuple(map(jnp.asarray, (x, gate, up)))

  def fn(a, g, u):
    return linear.swiglu(a, g, u, precision)

  for kernel in ("kvpage_swiglu", "kvpage_swiglu_bf16x3"):
    assert _custom_calls(fn, *args, target=kernel) == (1 if kernel == target else 0)
  got, want = np.asarray(jax.jit(fn)(*args)), _swiglu_float64(x, gate, up)
  if target != "kvpage_swiglu_bf16x3":  # fp32, and an exp to 2e-7
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(64))
    return
  # Each product within its bf16x3 bound (`test_bf16x3_products_...`), carried through
  # silu(g) * u: |silu'| <= 1.1, so the error is at most 1.1 |u| e_g + |silu(g)| e_u.
  a = np.abs(x).astype(np.float64)
  e_gate, e_up = ((3e-5 + 64 * 2e-7) * (a @ np.abs(w)) for w in (gate, up))
  g, u = x.astype(np.float64) @ gate, x.astype(np.float64) @ up
  bound = 1.1 * np.abs(u) * e_gate + np.abs(g / (1 + np.exp(-g))) * e_up + e_gate * e_up
  assert np.all(np.abs(got - want) <= bound)


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
  # q, k and v in one call, o, gate and up in one SwiGLU, down in every layer; the LM head.
  assert text.count('custom_call_target="kvpage_linear"') == 3 * model.num_layers + 1
  assert text.count('custom_call_target="kvpage_swiglu"') == model.num_layers


@pytest.mark.parametrize("key,value", [("linear_impl", "blas"), ("matmul_precision", "fast")])
def test_an_unknown_choice_is_refused(key, value):
  model = tiny_config.get_config().model
  model[key] = value
  with pytest.raises(ValueError, match=f"{key} '{value}'"):
    llama.random_init(model, seed=0)


def test_callers_on_several_threads_all_get_their_products():
  fn = jax.jit(kernel_linear)
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


@pytest.mark.parametrize("rows", [129, 200, 517])
@pytest.mark.parametrize("inner,columns", [(1, 32), (17, 96), (100, 64), (256, 512)])
def test_bf16x3_products_are_within_their_error_bound(rows, inner, columns):
  _need_amx()
  x, w = _operands(rows, inner, columns, seed=rows + inner)
  assert linear.target(rows, columns, jnp.float32, "high") == "kvpage_linear_bf16x3"
  got = np.asarray(jax.jit(lambda a, b: kernel_linear(a, b, "high"))(jnp.asarray(x),
                                                                      jnp.asarray(w)))
  want = x.astype(np.float64) @ w.astype(np.float64)
  # Each operand is split into two bf16 parts, exact to 2^-17 of its magnitude, and the
  # product of the low parts is dropped: every term is within ~3 * 2^-17 of exact,
  # plus fp32 accumulation.
  bound = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
  assert np.all(np.abs(got - want) <= (3e-5 + inner * 2e-7) * bound + 1e-30)
  # and it is not a plain bf16 product, whose error is a thousand times larger
  one_pass = (x.astype(jnp.bfloat16).astype(np.float64)
              @ w.astype(jnp.bfloat16).astype(np.float64))
  assert np.abs(got - want).max() < np.abs(one_pass - want).max() / 50


def test_the_precision_chooses_the_kernel():
  assert linear.target(64, 256, jnp.float32, "high") == "kvpage_linear"  # fp32, few rows
  assert linear.target(129, 256, jnp.float32, None) is None
  assert linear.target(129, 256, jnp.float32, jax.lax.Precision.HIGHEST) is None
  assert linear.target(129, 256, jnp.float32, "default") is None
  assert linear.target(129, 48, jnp.float32, "high") is None
  high = "kvpage_linear_bf16x3" if cpu.amx() else None
  assert linear.target(129, 256, jnp.float32, jax.lax.Precision.HIGH) == high
  assert linear.target(129, 256, jnp.float32, "bfloat16_3x") == high
  assert linear.target(129, 256, jnp.float32, ("high", "high")) == high
  assert linear.target(129, 256, jnp.float32, ("high", "highest")) == high  # the lower
  assert linear.target(129, 256, jnp.float32, ("default", "high")) is None
  assert linear.target(129, 256, jnp.float32,
                       jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3) == high
  assert linear.target(129, 256, jnp.float32,
                       jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6) is None
  for name in ("tensorfloat32", "BF16_BF16_F32_X3"):
    with jax.default_matmul_precision(name):
      assert linear.target(129, 256, jnp.float32, None) == high


def _prefill_step_text(model) -> str:
  params = llama.random_init(model, seed=1)
  batch = batch_lib.example_batch(num_tokens=256, num_seqs=2, max_pages_per_seq=32)
  cache = paged_cache.init(model, num_pages=65, page_size=4)
  return jax.jit(lambda p, c, b: llama.forward(p, c, b, config=model)).lower(
      params, cache, batch).compile().as_text()


@pytest.mark.parametrize("precision", ["high", "highest"])
def test_a_prefill_step_at_high_precision_runs_its_products_on_amx(precision):
  _need_amx()
  model = tiny_config.get_config().model
  model.linear_impl, model.matmul_precision = "cpu", precision
  text = _prefill_step_text(model)
  amx = 1 if precision == "high" else 0
  # q/k/v, o and down of 256 rows in every layer, and its SwiGLU; the LM head's 2 rows
  # in fp32 (on the kernel of few rows).
  assert text.count('custom_call_target="kvpage_linear_bf16x3"') == 3 * model.num_layers * amx
  assert text.count('custom_call_target="kvpage_swiglu_bf16x3"') == model.num_layers * amx
  assert text.count('custom_call_target="kvpage_linear"') == 1
  # and attention's prompt chunks (head_dim 64) on AMX too
  assert text.count('custom_call_target="kvpage_paged_prefill_bf16x3"') == model.num_layers * amx
  assert text.count('custom_call_target="kvpage_paged_prefill"') == model.num_layers * (1 - amx)


def test_long_prompts_at_high_precision_keep_the_tokens_of_fp32():
  _need_amx()
  rng = np.random.default_rng(5)
  prompts = [rng.integers(1, 500, size=n).tolist() for n in (300, 180, 7)]
  tokens = {precision: tiny_config.greedy_tokens(tiny_config.mixed_step_engine(
      chunk_size=512, num_pages=160, linear_impl="cpu", matmul_precision=precision), prompts, 12)
      for precision in ("high", "highest")}
  assert tokens["high"] == tokens["highest"]


@pytest.mark.parametrize("rows", [64, 200])  # fp32 kernel (XLA norm and add); AMX (fused)
def test_the_norm_and_the_residual_are_those_of_xla(rows):
  if rows > linear.MAX_ROWS:
    _need_amx()
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((rows, 96)) * 3, jnp.float32)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, 96), jnp.float32)
  residual = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
  w, gate, up = (jnp.asarray(rng.standard_normal((96, 64)) * 0.1, jnp.float32)
                 for _ in range(3))
  norm = (scale, 1e-5)

  def fused(x, scale, residual, w, gate, up):
    (out,) = linear.project(x, [w], "high", norm=(scale, 1e-5), residual=residual)
    return out, linear.swiglu(x, gate, up, "high", norm=(scale, 1e-5))

  got_out, got_mlp = jax.jit(fused)(x, scale, residual, w, gate, up)
  h = np.asarray(xla.rms_norm(x, *norm), np.float64)
  assert not np.allclose(h, np.asarray(x))  # the norm does something here
  want_out = np.asarray(residual, np.float64) + h @ np.asarray(w, np.float64)
  g, u = h @ np.asarray(gate, np.float64), h @ np.asarray(up, np.float64)
  want_mlp = g / (1 + np.exp(-g)) * u
  np.testing.assert_allclose(np.asarray(got_out), want_out, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(got_mlp), want_mlp, rtol=1e-4, atol=1e-4)
  text = jax.jit(fused).lower(x, scale, residual, w, gate, up).compile().as_text()
  # On AMX the norm and the add happen in the kernels: no reduction left to XLA.
  assert (" reduce(" in text) == (rows <= linear.MAX_ROWS)
