"""Matrix products over few rows on all CPU cores (`linear.cc`), as a Flax `dot_general`.

XLA:CPU runs a product of a few dozen rows on one core. A decode step is made of such
products (every projection and MLP product of every layer, at one row per sequence),
so one engine on a 2-core machine leaves a core idle for most of each decode step.
`linear.cc` splits each product over kvpage's worker threads, which stay awake between
the kernels of a step. Large products (prompt chunks) stay with XLA, which splits them
over its own threads and runs them faster than this kernel.

With `Precision.HIGH` (JAX's "bf16_3x": three bf16 passes), large products go to
`linear_amx.cc` instead, on CPUs with AMX: about twice XLA's fp32 speed, within ~1e-5
relative of fp32 (more accurate than TF32, JAX's default for fp32 products on GPUs).
Without it, or at `HIGHEST`, they stay with XLA in fp32.

`dot_general` is a drop-in for `jax.lax.dot_general` in `nn.Dense`: it takes the
products it can (`target`) and hands every other one to XLA unchanged, so a model
compiles on any backend. The choice is made per shape and precision, at trace time.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp

from kvpage.device import cpu

# Rows up to which the kernel beats XLA:CPU on the 2-core reference machine: a tiny
# model's dense layers (benchmarks/dense_cpu.py) at 32 / 64 / 128 rows took 0.99 / 1.58 /
# 3.03 ms on the kernel against 1.42 / 2.28 / 3.19 ms on XLA; at 192 rows, 4.99 against
# 4.15 ms, and XLA's lead grows with the rows (48 against 35 ms at 2,048).
MAX_ROWS = 128
PANEL = 32  # result columns a task computes (linear.cc's kPanel)


def _precision(precision: Any) -> jax.lax.Precision | None:
  """A `dot_general` precision argument (None, a `Precision` or its name, an algorithm
  preset, or a pair of them) as one `Precision`, the lower of a pair; None for anything
  else (another algorithm). None defers to `jax_default_matmul_precision`."""
  if isinstance(precision, (tuple, list)):
    pair = [_precision(p) for p in precision]
    return None if None in pair else min(pair, key=lambda p: p.value)
  if precision is None:
    precision = jax.config.jax_default_matmul_precision or "default"
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    precision = precision.name
  if precision == "BF16_BF16_F32_X3":  # the algorithm `Precision.HIGH` names
    return jax.lax.Precision.HIGH
  try:
    return jax.lax.Precision(precision)
  except (ValueError, TypeError):
    return None


def target(rows: int, columns: int, dtype: Any, precision: Any = None) -> str | None:
  """The kernel (FFI target) that computes a product of `rows` rows into `columns`
  columns, or None where XLA does: on the CPU backend with the kernels built, in fp32
  with a multiple of 32 columns, `kvpage_linear` takes up to `MAX_ROWS` rows, and at
  `Precision.HIGH` on a CPU with AMX (`kvpage.device.cpu.amx`) `kvpage_linear_bf16x3`
  takes more."""
  if not (rows > 0 and columns % PANEL == 0 and jnp.dtype(dtype) == jnp.float32
          and jax.default_backend() == "cpu" and cpu.status() == "ready"):
    return None
  if rows <= MAX_ROWS:
    return "kvpage_linear"
  if _precision(precision) == jax.lax.Precision.HIGH and cpu.amx():
    return "kvpage_linear_bf16x3"
  return None


def runs(rows: int, columns: int, dtype: Any, precision: Any = None) -> bool:
  """Whether a product goes through one of the kernels (`target`)."""
  return target(rows, columns, dtype, precision) is not None


def linear(x: jax.Array, w: jax.Array, precision: Any = None) -> jax.Array:
  """`x @ w` for `x` f32[..., K] and `w` f32[K, N], on the kernel `target` names;
  raises `ValueError` where none runs."""
  rows = math.prod(x.shape[:-1])
  name = None
  if w.ndim == 2 and x.shape[-1] == w.shape[0] and x.dtype == w.dtype:
    name = target(rows, w.shape[1], w.dtype, precision)
  if name is None:
    raise ValueError(f"the CPU linear kernels do not run here ({cpu.status()}; backend "
                     f"{jax.default_backend()}, x {x.dtype}{list(x.shape)}, w "
                     f"{w.dtype}{list(w.shape)}, precision {precision})")
  call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((rows, w.shape[1]), x.dtype))
  return call(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                precision: Any = None, preferred_element_type: Any = None) -> jax.Array:
  """`jax.lax.dot_general`, with `nn.Dense`'s products (the last axis of `lhs` against
  the first of a 2-D `rhs`) on a kernel where one runs."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  dense = (tuple(lhs_contract) == (lhs.ndim - 1,) and tuple(rhs_contract) == (0,)
           and not lhs_batch and not rhs_batch and rhs.ndim == 2)
  out_dtype = jnp.result_type(lhs, rhs) if preferred_element_type is None else jnp.dtype(
      preferred_element_type)
  if (dense and lhs.dtype == rhs.dtype == out_dtype
      and runs(math.prod(lhs.shape[:-1]), rhs.shape[1], rhs.dtype, precision)):
    return linear(lhs, rhs, precision)
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type)
