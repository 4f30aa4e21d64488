"""Matrix products over few rows on all CPU cores (`linear.cc`), as a Flax `dot_general`.

XLA:CPU runs a product of a few dozen rows on one core. A decode step is made of such
products (every projection and MLP product of every layer, at one row per sequence),
so one engine on a 2-core machine leaves a core idle for most of each decode step.
`linear.cc` splits each product over kvpage's worker threads, which stay awake between
the kernels of a step. Large products (prompt chunks) stay with XLA, which splits them
over its own threads and runs them faster than this kernel.

`dot_general` is a drop-in for `jax.lax.dot_general` in `nn.Dense`: it takes the
products it can (`runs`) and hands every other one to XLA unchanged, so a model
compiles on any backend. The choice is made per shape, at trace time.
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


def runs(rows: int, columns: int, dtype: Any) -> bool:
  """Whether a product of `rows` rows into `columns` columns goes through the kernel: on
  the CPU backend, with the kernels built, fp32, at most `MAX_ROWS` rows and a multiple
  of 32 columns."""
  return (0 < rows <= MAX_ROWS and columns % PANEL == 0 and jnp.dtype(dtype) == jnp.float32
          and jax.default_backend() == "cpu" and cpu.status() == "ready")


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
  """`x @ w` for `x` f32[..., K] and `w` f32[K, N], on the kernel; raises `ValueError`
  where it does not run (`runs`)."""
  rows = math.prod(x.shape[:-1])
  if (w.ndim != 2 or x.shape[-1] != w.shape[0] or x.dtype != w.dtype
      or not runs(rows, w.shape[1], w.dtype)):
    raise ValueError(f"the CPU linear kernel does not run here ({cpu.status()}; backend "
                     f"{jax.default_backend()}, x {x.dtype}{list(x.shape)}, w "
                     f"{w.dtype}{list(w.shape)})")
  call = jax.ffi.ffi_call("kvpage_linear", jax.ShapeDtypeStruct((rows, w.shape[1]), x.dtype))
  return call(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                precision: Any = None, preferred_element_type: Any = None) -> jax.Array:
  """`jax.lax.dot_general`, with `nn.Dense`'s products (the last axis of `lhs` against
  the first of a 2-D `rhs`) on the kernel where it runs."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  dense = (tuple(lhs_contract) == (lhs.ndim - 1,) and tuple(rhs_contract) == (0,)
           and not lhs_batch and not rhs_batch and rhs.ndim == 2)
  out_dtype = jnp.result_type(lhs, rhs) if preferred_element_type is None else jnp.dtype(
      preferred_element_type)
  if (dense and lhs.dtype == rhs.dtype == out_dtype
      and runs(math.prod(lhs.shape[:-1]), rhs.shape[1], rhs.dtype)):
    return linear(lhs, rhs)
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type)
