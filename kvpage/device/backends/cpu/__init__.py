"""The CPU backend: kvpage's native kernels (C++ behind XLA's FFI) on the XLA backend.

XLA:CPU leaves two things on the table that serving needs, and the kernels take them
back (`native.py` loads them; the sources sit beside it):

  * attention that reads the pages where they lie (`attention.py`), for decode rows and
    prompt chunks, where XLA:CPU gathers them into a fresh copy first;
  * a step's products over a few dozen rows on all cores (`linear.py`), where XLA:CPU
    runs them on one, and prompt chunks' products on AMX in three bf16 passes at
    `Precision.HIGH`.

Everything else, and every row or product the kernels do not take (another device, a
dtype or head size they are not built for, a tensor-parallel step, a library that did
not load), is the XLA backend's: this backend is the XLA one with rows and products
handed over where the kernels run, so its tokens equal the XLA backend's up to float
rounding, and `describe` says which ran.
"""

import functools
from typing import Any

import jax

from kvpage.device.backends import xla
from kvpage.device.backends.cpu import attention as cpu_attention
from kvpage.device.backends.cpu import linear as cpu_linear
from kvpage.device.backends.cpu import native
from kvpage.device.backends.xla import RowKernels
from kvpage.device.sharding import TensorParallel
from kvpage.interface import CostTraits


def row_kernels(q: jax.Array, k_pages: jax.Array, precision: Any) -> RowKernels:
  """The rows of a step the kernels compute for `q [num_tokens, num_heads, head_dim]`
  over pages `[..., num_kv_heads, num_pages, page_size, head_dim]`: decode rows and
  prompt chunks where each kernel runs (`cpu_attention.runs`, `prefill_runs`)."""
  group, head_dim = q.shape[-2] // k_pages.shape[-4], q.shape[-1]
  decode = cpu_attention.paged_decode if cpu_attention.runs(k_pages.dtype, group,
                                                            head_dim) else None
  prompt_chunks = (functools.partial(cpu_attention.paged_prefill, precision=precision)
                   if cpu_attention.prefill_runs(k_pages.dtype, head_dim) else None)
  return RowKernels(decode, prompt_chunks)


def attend(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, layer: int,
              page_tables: jax.Array, context_lens: jax.Array, query_start_loc: jax.Array,
              decode_only: bool, precision: Any = None) -> jax.Array:
  """The XLA backend's attention with its decode rows and prompt chunks on the
  kernels where they run (`row_kernels`)."""
  return xla.attend(q, k_pages, v_pages, layer=layer, page_tables=page_tables,
                       context_lens=context_lens, query_start_loc=query_start_loc,
                       decode_only=decode_only, kernels=row_kernels(q, k_pages, precision))


class Linear(xla.Linear):
  """A layer's products on the kernels where they run (`cpu_linear.target`): the
  projections of one input in one call, SwiGLU's two products with their activation,
  and on AMX the RMSNorm and the residual add as well; XLA's elsewhere."""

  def project(self, x: jax.Array, weights: Any, *,
              norm: tuple[jax.Array, float] | None = None,
              residual: jax.Array | None = None) -> list[jax.Array]:
    return cpu_linear.project(x, weights, self.precision, norm=norm, residual=residual)

  def swiglu(self, x: jax.Array, gate: jax.Array, up: jax.Array, *,
             norm: tuple[jax.Array, float] | None = None) -> jax.Array:
    return cpu_linear.swiglu(x, gate, up, self.precision, norm=norm)


def products(precision: Any, tensor_parallel: TensorParallel | None) -> xla.Linear:
  """The products of a step: on the kernels on one device; a tensor-parallel step's
  stay on XLA, whose partitioner splits them over the devices (it cannot split a
  custom call: it would gather the weights whole)."""
  if tensor_parallel is not None:
    return xla.Linear(precision, tensor_parallel)
  return Linear(precision)


def runs_here() -> bool:
  """Whether the kernels can run in this process: the CPU backend, the library loaded."""
  return jax.default_backend() == "cpu" and native.status() == "ready"


def decode_reads_longest(kv_dtype: Any, group: int, head_dim: int) -> bool:
  """Decode rows the kernel takes read their own context; the XLA path's, the longest."""
  return not cpu_attention.runs(kv_dtype, group, head_dim)


def swiglu_fused(tensor_parallel: int) -> bool:
  """Whether SwiGLU's two products are one kernel call (one device, the kernels here)."""
  return tensor_parallel == 1 and runs_here()


def describe_attention(kv_dtype: Any, group: int, head_dim: int) -> str:
  """Which attention rows the kernels compute here, for the run records."""
  runs = runs_here()
  decode = "native" if runs and cpu_attention.runs(kv_dtype, group, head_dim) else "xla"
  chunks = "native" if runs and cpu_attention.prefill_runs(kv_dtype, head_dim) else "xla"
  return f"decode rows {decode}, prompt chunks {chunks}"


def describe_products(dtype: Any, precision: Any, tensor_parallel: int) -> str:
  """Which products the kernels compute here (`products`), for the run records."""
  if tensor_parallel > 1:
    return "xla (tensor parallel)"
  return cpu_linear.describe(dtype, precision) if runs_here() else "xla"


def traits(*, attention: bool, linear: bool, kv_dtype: Any, group: int, head_dim: int,
           tensor_parallel: int) -> CostTraits:
  """Cost traits where this backend computes the attention (`attention`) and/or the
  products (`linear`); the XLA backend's for the rest."""
  return xla.traits(
      decode_reads_longest=(decode_reads_longest(kv_dtype, group, head_dim) if attention
                            else True),
      swiglu_fused=linear and swiglu_fused(tensor_parallel))
