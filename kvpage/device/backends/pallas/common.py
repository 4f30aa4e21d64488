"""Pieces the paged-attention kernels share: the online-softmax step, tiling, lowering.

Both kernels (`decode.py`, `ragged.py`) walk a sequence's page table one KV tile (a few
pages) at a time and fold each tile of keys into a running softmax kept in fp32
(Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022), so that one pass over the
KV pages suffices whatever the context length. `online_softmax_step` is that fold for
a kernel body: the two matmuls as Triton `tl.dot`s, around the same online-softmax
update the oracle and the XLA paths use (`reference.online_softmax_update`).

Lowering. Every kernel here is lowered with Pallas' **Triton** backend, selected
explicitly by passing `triton.CompilerParams`. Which backend a `pl.pallas_call` with no
compiler parameters gets on GPU differs across the releases kvpage supports, so the
kernels do not rely on the default:
  * jax 0.10.x (and up to 0.11.1): Mosaic GPU is the default; Triton when asked for.
  * jax 0.11.2 and 0.12: `pl.pallas_call` on GPU always lowers through Triton, with a
    DeprecationWarning at lowering (the backend is deprecated since 0.11.0); Mosaic GPU
    is reachable only through `plgpu.kernel`.
Lowering for CUDA on a machine without a GPU needs, since 0.11, an abstract GPU device
on the current abstract mesh (`tests/test_kernels.py` shows how). Triton, deliberately:
  * The kernel body uses only generic Pallas (ref indexing, `dot_general`, `fori_loop`), so
    the *same* body runs in interpret mode on CPU, where CI checks it against the
    reference, and lowers to Triton IR, which a CPU machine can also check
    (`tests/test_kernels.py` lowers both kernels for `cuda`). Only Triton's own PTX
    compile is left for the GPU.
  * A paged read is a gather of data-dependent pages. Triton does that with pointer
    arithmetic (`k_pages_ref[pages]`); Mosaic GPU needs a TMA copy per page into
    shared memory, barriers and warpgroup layouts whose matmuls want 64-row tiles,
    while a decode step has only `num_heads / num_kv_heads` (4 here) query rows per KV
    head. That is a different program, and one no CPU test can execute.
  * JAX's own `ops.gpu.paged_attention`, the baseline we benchmark against, uses the
    same backend and layout, so the comparison is like for like.
The cost: the Triton backend is deprecated (since JAX 0.11) and may go away. It is
confined to `compiler_params` below; a `plgpu.kernel` port is the way out when it does.
"""

import math

import jax
import jax.numpy as jnp

from kvpage.device.attention import reference
from kvpage.units import cdiv

try:  # The Triton backend may be removed from future JAX releases (see above).
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - depends on the installed JAX
  pltriton = None

# Triton's `tl.dot` needs every operand dim >= 16, and its loads power-of-two sizes.
MIN_DOT_DIM = 16
# Flash-Decoding (Dao et al. 2023) splits long contexts so that a small batch still
# fills the GPU: aim for about two waves of programs over an H200's 132 SMs.
TARGET_PROGRAMS = 264


def next_power_of_2(n: int) -> int:
  return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))


def compiler_params(interpret: bool, *, num_warps: int = 4, num_stages: int = 2):
  """Backend parameters that pin the GPU lowering to Triton (none needed to interpret)."""
  if interpret:
    return None
  if pltriton is None:
    raise NotImplementedError(
        "this JAX has no Pallas Triton backend (jax.experimental.pallas.triton); the kvpage "
        "kernels need it on GPU. Use attention_impl='reference' or interpret=True.")
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_tiling(page_size: int, head_dim: int, interpret: bool) -> None:
  """Triton loads whole pages: their sizes must be powers of two (interpret mode is lax)."""
  if interpret:
    return
  for name, value in (("page_size", page_size), ("head_dim", head_dim)):
    if value != next_power_of_2(value):
      raise ValueError(f"the GPU kernels need a power-of-two {name}, got {value}")


def pages_per_tile(page_size: int, max_pages: int, target_tokens: int) -> int:
  """Pages folded per loop step: about `target_tokens` keys, a power of two, and at
  least `MIN_DOT_DIM` keys so the score matmul is a legal `tl.dot`."""
  pages = min(max(1, target_tokens // page_size), next_power_of_2(max_pages))
  return next_power_of_2(max(pages, cdiv(MIN_DOT_DIM, page_size)))


def dot_precision(dtype: jnp.dtype):
  """fp32 inputs get IEEE fp32 matmuls (not TF32); half inputs the native MMA."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def group_queries(q: jax.Array, num_kv_heads: int, padded_group: int) -> jax.Array:
  """`[n, num_heads, d]` -> `[num_kv_heads, n, padded_group, d]`, zero-padding the group.

  Query head h reads KV head h // group (GQA, Ainslie et al. 2023); padding the group
  to a power of two keeps every load and matmul Triton-legal. Padded rows are dropped.
  """
  n, num_heads, head_dim = q.shape
  group = num_heads // num_kv_heads
  q = q.reshape(n, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
  return jnp.pad(q, ((0, 0), (0, 0), (0, padded_group - group), (0, 0)))


def _dot(a, b, *, contract_rhs: int, precision):
  """`a @ b` (or `a @ b.T` when `contract_rhs` is 1) accumulated in fp32: one `tl.dot`."""
  return jax.lax.dot_general(a, b, (((1,), (contract_rhs,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def online_softmax_step(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                        state: reference.SoftmaxState, *, sm_scale: float,
                        soft_cap: float | None, precision) -> reference.SoftmaxState:
  """Folds one KV tile into the running (max, denominator, accumulator) of a kernel body.

  Args:
    q: `[rows, head_dim]` queries (input dtype); k, v: `[tile_len, head_dim]`.
    visible: bool, broadcastable to `[rows, tile_len]`: which keys each row may see.
    state: `reference.init_softmax_state((rows,), head_dim)` or a previous step's.
  """
  scores = _dot(q, k, contract_rhs=1, precision=precision) * sm_scale  # f32[rows, tile_len]
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)
  scores = jnp.where(visible, scores, -jnp.inf)
  # FlashAttention feeds P to the second matmul in the input dtype (bf16 MMA on GPU).
  return reference.online_softmax_update(state, scores, lambda probs: _dot(
      probs.astype(v.dtype), v, contract_rhs=0, precision=precision))
