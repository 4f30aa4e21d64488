"""A model's matrix products on kvpage's CPU kernels, with XLA wherever they do not run.

XLA:CPU runs a product of a few dozen rows on one core. A decode step is made of such
products (every projection and MLP product of every layer, at one row per sequence),
so one engine on a 2-core machine leaves a core idle for most of each decode step.
`linear.cc` splits each product over kvpage's worker threads, which stay awake between
the kernels of a step, in fp32. Products of more rows (prompt chunks) stay with XLA,
which splits them over its own threads and runs them faster than that kernel in fp32.

With `Precision.HIGH` (JAX's "bf16_3x": three bf16 passes), products of more rows go to
`linear_amx.cc` instead, on CPUs with AMX: about twice XLA's fp32 speed, within ~1e-5
relative of fp32 (more accurate than TF32, JAX's default for fp32 products on GPUs).
Without AMX, or at `HIGHEST`, they stay with XLA in fp32.

Both kernels take the products of one input by several weights in one call
(`project`: q, k and v), and SwiGLU's two products with their `silu(gate) * up`
(`swiglu`), so the input is read once and the MLP's two products are never written
out. Each function falls back to XLA (`jax.lax.dot_general` at the same precision)
where no kernel runs (`target`), so a model compiles on any backend; the choice is made
per shape and precision, at trace time.
"""

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.device.backends.cpu import limits
from kvpage.device.backends.cpu import native as cpu
from kvpage.device.backends.xla import matmul as _xla
from kvpage.device.backends.xla import rms_norm

# Rows up to which the kernel beats XLA:CPU on the 2-core reference machine: a tiny
# model's dense layers (benchmarks/dense_cpu.py) at 32 / 64 / 128 rows took 0.99 / 1.58 /
# 3.03 ms on the kernel against 1.42 / 2.28 / 3.19 ms on XLA; at 192 rows, 4.99 against
# 4.15 ms, and XLA's lead grows with the rows (48 against 35 ms at 2,048).
MAX_ROWS = 128
PANEL = limits.PANEL  # result columns a task computes (linear.cc's kPanel)


def target(rows: int, columns: int, dtype: Any, precision: Any = None,
           swiglu: bool = False) -> str | None:
  """The kernel (FFI target) that computes products of `rows` rows into `columns`
  columns (plain, or SwiGLU's), or None where XLA does: on the CPU backend with the
  kernels built, in fp32 with a multiple of 32 columns, `linear.cc` takes up to
  `MAX_ROWS` rows, and at `Precision.HIGH` on a CPU with AMX (`native.amx`)
  `linear_amx.cc` takes more."""
  if not (rows > 0 and columns % PANEL == 0 and jnp.dtype(dtype) == jnp.float32
          and jax.default_backend() == "cpu" and cpu.status() == "ready"):
    return None
  kind = "swiglu" if swiglu else "linear"
  if rows <= MAX_ROWS:
    return f"kvpage_{kind}"
  if cpu.bf16x3(precision):
    return f"kvpage_{kind}_bf16x3"
  return None


def runs(rows: int, columns: int, dtype: Any, precision: Any = None) -> bool:
  """Whether a product goes through one of the kernels (`target`)."""
  return target(rows, columns, dtype, precision) is not None


def _kernel(x: jax.Array, weights: Sequence[jax.Array], precision: Any,
            swiglu: bool) -> tuple[str, int] | None:
  """The kernel that takes all of `weights`' products of `x` in one call, and the rows;
  None where there is none (shapes, dtypes, backend, precision)."""
  rows = math.prod(x.shape[:-1])
  names = {target(rows, w.shape[-1], w.dtype, precision, swiglu) if (
      w.ndim == 2 and w.shape[0] == x.shape[-1] and w.dtype == x.dtype) else None
      for w in weights}
  if swiglu and weights[0].shape != weights[1].shape:
    return None
  name = names.pop() if len(names) == 1 else None
  return None if name is None else (name, rows)


def _call(name: str, x: jax.Array, weights: Sequence[jax.Array], rows: int,
          columns: Sequence[int], norm: tuple[jax.Array, float] | None = None,
          residual: jax.Array | None = None) -> list[jax.Array]:
  results = [jax.ShapeDtypeStruct((rows, n), x.dtype) for n in columns]
  extras, attributes = [], {}
  if name.endswith("_bf16x3"):  # the AMX kernels take the norm and the residual
    extras = ([norm[0]] if norm else []) + ([residual.reshape(rows, -1)]
                                            if residual is not None else [])
    attributes = dict(norm=np.int64(norm is not None),
                      norm_eps=np.float32(norm[1] if norm else 0.0),
                      residual=np.int64(residual is not None))
  outs = jax.ffi.ffi_call(name, results)(x.reshape(rows, x.shape[-1]), *extras, *weights,
                                         **attributes)
  return [out.reshape(*x.shape[:-1], n) for out, n in zip(outs, columns)]


def project(x: jax.Array, weights: Sequence[jax.Array], precision: Any = None, *,
            norm: tuple[jax.Array, float] | None = None,
            residual: jax.Array | None = None) -> list[jax.Array]:
  """`[x @ w for w in weights]` for `x` [..., K] and each `w` [K, N_i]: in one kernel
  call where one kernel takes them all, else each on XLA at `precision`. With `norm`
  (scale, eps), `x` is `rms_norm`ed first; `residual` is added to the one result. The
  AMX kernel does both as it goes; elsewhere they are XLA passes of their own."""
  if residual is not None and len(weights) != 1:
    raise ValueError(f"a residual goes with one weight, got {len(weights)}")
  chosen = _kernel(x, weights, precision, swiglu=False)
  fused = chosen is not None and chosen[0].endswith("_bf16x3")
  if norm is not None and not fused:
    x, norm = rms_norm(x, *norm), None
  if chosen is None:
    outs = [_xla(x, w, precision) for w in weights]
  else:
    outs = _call(chosen[0], x, weights, chosen[1], [w.shape[1] for w in weights], norm,
                 residual if fused else None)
  if residual is not None and not fused:
    outs = [residual + outs[0]]
  return outs


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, precision: Any = None, *,
           norm: tuple[jax.Array, float] | None = None) -> jax.Array:
  """`silu(x @ w_gate) * (x @ w_up)`: in one kernel call where one runs (the products
  never leave it), else on XLA at `precision`; `norm` as in `project`."""
  chosen = _kernel(x, (w_gate, w_up), precision, swiglu=True)
  if norm is not None and not (chosen is not None and chosen[0].endswith("_bf16x3")):
    x, norm = rms_norm(x, *norm), None
  if chosen is None:
    return jax.nn.silu(_xla(x, w_gate, precision)) * _xla(x, w_up, precision)
  name, rows = chosen
  return _call(name, x, (w_gate, w_up), rows, [w_gate.shape[1]], norm)[0]


def describe(dtype: Any, precision: Any) -> str:
  """Which products the kernels take for weights of `dtype` at `precision`, here."""
  if jnp.dtype(dtype) != jnp.float32:
    return f"xla ({jnp.dtype(dtype).name}: the kernels are fp32)"
  many = "AMX, bf16x3" if cpu.bf16x3(precision) else "xla"
  return f"native up to {MAX_ROWS} rows, {many} above"
