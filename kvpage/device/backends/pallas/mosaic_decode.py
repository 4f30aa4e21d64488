"""Paged decode attention on Mosaic GPU (`plgpu.kernel`): the GPU path after Triton.

JAX deprecated the Pallas Triton backend in 0.11.0; Mosaic GPU, reached through
`plgpu.kernel` (jax >= 0.11.2), is the way forward, and the one that can use Hopper's
TMA and warpgroup layouts. The contract is `decode.paged_decode_attention`'s: one new
token per sequence, Flash-Decoding splits (Dao et al. 2023) for long contexts.

One program per (sequence, KV head, KV split), one warpgroup each. It walks its split
of the sequence's KV in blocks of `T = max(64, page_size)` tokens: a register tile of
`[T, head_dim]` must be a whole number of the warpgroup layout's 64 x 8 base tiles, so
smaller pages are gathered several to a block (one TMA copy and one barrier per page;
a TMA copy arrives on its own barrier, so copies never share one). Blocks are double
buffered in shared memory: block i + 1's pages are on their way while block i is
scored. The GQA group's query heads (1 to 8 on the models kvpage serves) are few, so
the math is vector math in float32 on the warpgroup layout, not wgmma:

    scores[t] = sum_d K[t, d] q[d],      acc[d] = alpha acc[d] + sum_t p[t] V[t, d]

with the online softmax in float32 per query head. Each split writes its normalized
output and its log-sum-exp; `merge_splits` weighs the splits in plain JAX.

Rules that real lowering enforces and interpret mode does not (checked by lowering
for an H200 on CPU in the tests): `T % 64 == 0` and `head_dim % 8 == 0`; before a TMA
copy writes a buffer that registers read in program order, `plgpu.commit_smem()` (a
proxy fence) must separate them, or the interpreter's race detector reports it.

Not yet: wgmma, warp specialization, and any measurement on a GPU (the first session
with one runs `benchmarks/kernel_gpu.py`). Default stays Triton until then.

File pattern: kernel body, `plgpu.kernel` wrapper, then the public API; the tests
check it against the oracle `reference.ragged_paged_attention`.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK_TOKENS = 64  # the warpgroup layout's row tile: a block of KV is a multiple of it
ROWS = plgpu.Layout.WGMMA.reduce(1)  # a [T] vector, one entry per token of a block
FEATURES = plgpu.Layout.WGMMA.reduce(0)  # a [head_dim] vector


def _decode_kernel(q_ref, k_pages_ref, v_pages_ref, page_tables_ref, context_lens_ref,
                   out_ref, lse_ref, q_smem, k_smem, v_smem, out_smem, lse_smem,
                   q_barrier, k_barriers, v_barriers, *, group, block_tokens, page_size,
                   blocks_per_split, sm_scale):
  # q_ref: [num_seqs, num_heads, head_dim]; k/v_pages_ref: [num_kv_heads, num_pages,
  # page_size, head_dim]; page_tables_ref: i32[num_seqs, num_blocks * pages_per_block];
  # context_lens_ref: i32[num_seqs]; out_ref, lse_ref: f32[num_seqs, num_kv_heads,
  # num_splits, group, head_dim]; k/v_smem: [2, block_tokens, head_dim] (two buffers).
  seq, kv_head, split = (lax.axis_index(name) for name in ("seq", "kv_head", "split"))
  head_dim = q_smem.shape[-1]
  pages_per_block = block_tokens // page_size
  context_len = context_lens_ref[seq]
  first = split * blocks_per_split
  num_blocks = (context_len + block_tokens - 1) // block_tokens
  count = jnp.maximum(jnp.minimum(first + blocks_per_split, num_blocks) - first, 0)

  def fetch(block, buffer):
    """Starts the TMA copies of block `block`'s pages into buffer `buffer`."""
    for i in range(pages_per_block):
      page = page_tables_ref[seq, block * pages_per_block + i]
      rows, barrier = pl.ds(i * page_size, page_size), buffer * pages_per_block + i
      plgpu.copy_gmem_to_smem(k_pages_ref.at[kv_head, page], k_smem.at[buffer, rows],
                              k_barriers.at[barrier])
      plgpu.copy_gmem_to_smem(v_pages_ref.at[kv_head, page], v_smem.at[buffer, rows],
                              v_barriers.at[barrier])

  def wait(barriers, buffer):
    for i in range(pages_per_block):
      plgpu.barrier_wait(barriers.at[buffer * pages_per_block + i])

  pl.when(count > 0)(lambda: fetch(first, 0))
  plgpu.copy_gmem_to_smem(q_ref.at[seq, pl.ds(kv_head * group, group)], q_smem,
                          q_barrier.at[0])
  plgpu.barrier_wait(q_barrier.at[0])
  queries = [plgpu.load(q_smem.at[g], layout=FEATURES).astype(jnp.float32) * sm_scale
             for g in range(group)]

  def step(i, carry):
    running_max, denominator, acc = carry
    buffer, block = lax.rem(i, 2), first + i

    @pl.when(i + 1 < count)
    def _prefetch():
      plgpu.commit_smem()  # the other buffer was read last step: fence before TMA writes
      fetch(block + 1, 1 - buffer)

    wait(k_barriers, buffer)
    keys = plgpu.load(k_smem.at[buffer], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    tokens = block * block_tokens + plgpu.broadcasted_iota(
        jnp.int32, (block_tokens,), 0, layout=ROWS)
    visible = tokens < context_len
    probs, new_max, alpha = [], [], []
    for g in range(group):
      scores = jnp.sum(keys * lax.broadcast_in_dim(queries[g], keys.shape, (1,)), axis=1)
      scores = jnp.where(visible, scores, -jnp.inf)
      new_max.append(jnp.maximum(running_max[g], jnp.max(scores)))
      probs.append(jnp.exp(scores - new_max[g]))
      alpha.append(jnp.exp(running_max[g] - new_max[g]))
    wait(v_barriers, buffer)
    values = plgpu.load(v_smem.at[buffer], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    return (tuple(new_max),
            tuple(denominator[g] * alpha[g] + jnp.sum(probs[g]) for g in range(group)),
            tuple(acc[g] * alpha[g] + jnp.sum(
                lax.broadcast_in_dim(probs[g], values.shape, (0,)) * values, axis=0)
                  for g in range(group)))

  init = (tuple(jnp.float32(-jnp.inf) for _ in range(group)),
          tuple(jnp.float32(0.0) for _ in range(group)),
          tuple(plgpu.layout_cast(jnp.zeros((head_dim,), jnp.float32), FEATURES)
                for _ in range(group)))
  running_max, denominator, acc = lax.fori_loop(0, count, step, init)
  for g in range(group):
    seen = denominator[g] > 0  # a split (or a padding row) with no token: zeros, lse -inf
    safe = jnp.where(seen, denominator[g], 1.0)
    out_smem[g] = acc[g] / safe
    # The log-sum-exp as a [head_dim] row: the same layout and copy shape as the output.
    lse_smem[g] = acc[g] * 0.0 + jnp.where(seen, running_max[g] + jnp.log(safe), -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_ref.at[seq, kv_head, split])
  plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[seq, kv_head, split])
  plgpu.wait_smem_to_gmem(0)


def check_supported(interpret: bool) -> None:
  """Raises NotImplementedError unless this JAX runs the kernel: Mosaic GPU through
  `plgpu.kernel`, and its interpreter when `interpret` (jax >= 0.11.2)."""
  if interpret and not hasattr(plgpu, "InterpretGPUParams"):
    raise NotImplementedError(
        f"the Mosaic GPU decode kernel runs on CPU only through Mosaic GPU's interpreter, "
        f"which jax {jax.__version__} lacks (jax >= 0.11.2 has it); choose another "
        "attention_impl, or run on Python 3.12 with a newer jax")


def block_tokens(page_size: int) -> int:
  """Tokens per KV block: a multiple of the layout's 64 rows, whole pages."""
  if page_size < BLOCK_TOKENS and BLOCK_TOKENS % page_size == 0:
    return BLOCK_TOKENS
  if page_size % BLOCK_TOKENS == 0:
    return page_size
  raise ValueError(f"the Mosaic GPU decode kernel needs a page size that divides "
                   f"{BLOCK_TOKENS} or is a multiple of it, got {page_size}")


def _decode_call(q, k_pages, v_pages, page_tables, context_lens, *, num_splits, sm_scale,
                 interpret):
  num_seqs, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  tokens = block_tokens(page_size)
  pages_per_block = tokens // page_size
  num_blocks = -(-page_tables.shape[1] // pages_per_block)
  num_splits = max(1, min(num_splits, num_blocks))
  blocks_per_split = -(-num_blocks // num_splits)
  # Whole blocks: the extra entries point at the null page, masked by the context length.
  page_tables = jnp.pad(page_tables.astype(jnp.int32),
                        ((0, 0), (0, num_blocks * pages_per_block - page_tables.shape[1])))
  kernel = functools.partial(_decode_kernel, group=group, block_tokens=tokens,
                             page_size=page_size, blocks_per_split=blocks_per_split,
                             sm_scale=sm_scale)
  parts = jax.ShapeDtypeStruct((num_seqs, num_kv_heads, num_splits, group, head_dim),
                               jnp.float32)
  buffers = plgpu.SMEM((2, tokens, head_dim), k_pages.dtype)
  return plgpu.kernel(
      kernel, out_type=(parts, parts),
      scratch_types=(plgpu.SMEM((group, head_dim), q.dtype), buffers, buffers,
                     plgpu.SMEM((group, head_dim), jnp.float32),
                     plgpu.SMEM((group, head_dim), jnp.float32),
                     plgpu.Barrier(num_barriers=1),
                     plgpu.Barrier(num_barriers=2 * pages_per_block),
                     plgpu.Barrier(num_barriers=2 * pages_per_block)),
      grid=(num_seqs, num_kv_heads, num_splits), grid_names=("seq", "kv_head", "split"),
      interpret=plgpu.InterpretGPUParams() if interpret else False,
  )(q, k_pages, v_pages, page_tables, context_lens.astype(jnp.int32))


def merge_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
  """Flash-Decoding's combine: `out` f32[..., num_splits, group, head_dim] normalized per
  split, `lse` its log-sum-exp (per row, broadcast along head_dim); splits without a
  token (lse -inf) weigh nothing, and a row with none at all stays zero."""
  lse = lse[..., 0]  # [..., num_splits, group]
  top = jnp.max(lse, axis=-2, keepdims=True)
  weights = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0))
  total = jnp.sum(weights, axis=-2, keepdims=True)
  weights = weights / jnp.where(total > 0, total, 1.0)
  return jnp.sum(out * weights[..., None], axis=-3)


@functools.partial(jax.jit, static_argnames=("num_splits", "sm_scale", "interpret"))
def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                           page_tables: jax.Array, context_lens: jax.Array,
                           num_splits: int = 1, sm_scale: float | None = None,
                           interpret: bool = False) -> jax.Array:
  """One new token per sequence attending over its pages, on Mosaic GPU.

  Args:
    q: `[num_seqs, num_heads, head_dim]`, head_dim a multiple of 8.
    k_pages, v_pages: `[num_kv_heads, num_pages, page_size, head_dim]`, page_size a
      divisor or a multiple of 64.
    page_tables: `i32[num_seqs, max_pages_per_seq]`, padded with the null page.
    context_lens: `i32[num_seqs]`; 0 for a padding row (its output is zeros).
    num_splits: KV splits per sequence (Flash-Decoding), merged after the kernel.
    sm_scale: score scale; defaults to `1 / sqrt(head_dim)`.
    interpret: run Mosaic GPU's interpreter (required on CPU).
  Returns:
    `[num_seqs, num_heads, head_dim]` in `q.dtype`.
  """
  num_seqs, num_heads, head_dim = q.shape
  if head_dim % 8 or num_heads % k_pages.shape[0]:
    raise ValueError(f"head_dim {head_dim} must be a multiple of 8 and num_heads "
                     f"{num_heads} a multiple of num_kv_heads {k_pages.shape[0]}")
  scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  out, lse = _decode_call(q, k_pages, v_pages, page_tables, context_lens,
                          num_splits=num_splits, sm_scale=scale, interpret=interpret)
  merged = out[:, :, 0] if out.shape[2] == 1 else merge_splits(out, lse)
  return merged.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
