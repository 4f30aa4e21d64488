r"""Decode attention over a paged vs a contiguous KV cache on CPU, and their fragmentation.

  python -m benchmarks.attention_cpu --config=configs/tiny.py --out=attention_cpu.json

Part 1 times one layer's decode attention (one new token per sequence) at batch
1/8/32 and context 256/1024/4096: kvpage's reference `ragged_paged_attention` and its
decode-only fast path `paged_decode_attention` (what the model runs on decode-only
steps), both reading randomly permuted pages through page tables (the table as
wide as the context needs, unpadded), against attention over a contiguous
`[batch, kv_heads, max_len, head_dim]` cache of exactly the context length (the
contiguous best case). Both jitted; median of `--repeats` calls after warm-up.

Part 2 measures memory: for a lognormal length mix (median ~300 tokens, capped at
4096) it compares the KV memory a paged cache reserves (whole pages of 16 tokens)
with contiguous max-length preallocation, and the fraction of each holding real tokens.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from ml_collections import config_flags

from benchmarks import contiguous, timing
from experiments import cli
from kvpage import model_shape, premises
from kvpage.device import cache as paged_cache
from kvpage.device.attention import reference
from kvpage.device.backends.xla import attention as xla
from kvpage.sim import capacity

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Model config.")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Batch sizes.")
_CONTEXTS = flags.DEFINE_list("contexts", ["256", "1024", "4096"], "Context lengths.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed calls per cell.")
_NUM_SEQS = flags.DEFINE_integer("num_seqs", 10_000, "Sequences in the fragmentation mix.")
_MEDIAN_LEN = flags.DEFINE_integer("median_len", 300, "Median of the lognormal length mix.")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "Max length (contiguous reservation).")
_SIGMA = flags.DEFINE_float("sigma", 1.0, "Lognormal sigma of the length mix.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_OUT = flags.DEFINE_string("out", "attention_cpu.json", "Where to write the JSON record.")


def time_decode(batch: int, context: int, model, page_size: int, repeats: int,
                rng: np.random.Generator) -> dict[str, float]:
  """Seconds per decode-attention call, paged and contiguous, for one cell."""
  num_heads, num_kv_heads, head_dim = model.num_heads, model.num_kv_heads, model.head_dim
  dtype = paged_cache.jnp_dtype(model.dtype)
  pages_per_seq = -(-context // page_size)
  num_pages = 1 + batch * pages_per_seq
  tables = rng.permutation(np.arange(1, num_pages)).reshape(batch, pages_per_seq)
  q = jnp.asarray(rng.standard_normal((batch, num_heads, head_dim)), dtype)
  k_pages = jnp.asarray(rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)),
                        dtype)
  v_pages = jnp.asarray(rng.standard_normal(k_pages.shape), dtype)
  lengths = jnp.full((batch,), context, jnp.int32)
  paged = jax.jit(functools.partial(
      reference.ragged_paged_attention, page_tables=jnp.asarray(tables, jnp.int32),
      context_lens=lengths, query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32)))
  k = jnp.asarray(rng.standard_normal((batch, num_kv_heads, context, head_dim)), dtype)
  v = jnp.asarray(rng.standard_normal(k.shape), dtype)
  fast = jax.jit(functools.partial(
      xla.paged_decode_attention, page_tables=jnp.asarray(tables, jnp.int32),
      context_lens=lengths))
  dense = jax.jit(contiguous.decode_attention)
  calls = dict(paged=lambda: paged(q, k_pages, v_pages).block_until_ready(),
               fast=lambda: fast(q, k_pages, v_pages).block_until_ready(),
               contiguous=lambda: dense(q, k, v, lengths).block_until_ready())
  seconds = timing.interleaved(calls, repeats=repeats)
  paged_s, fast_s, dense_s = seconds["paged"], seconds["fast"], seconds["contiguous"]
  kv_bytes = 2 * batch * context * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
  return dict(batch=batch, context=context, paged_ms=paged_s * 1e3, fast_ms=fast_s * 1e3,
              contiguous_ms=dense_s * 1e3, ratio=paged_s / dense_s,
              fast_ratio=fast_s / dense_s, kv_bytes=kv_bytes,
              paged_gb_per_s=kv_bytes / paged_s / 1e9, fast_gb_per_s=kv_bytes / fast_s / 1e9,
              contiguous_gb_per_s=kv_bytes / dense_s / 1e9)


def lognormal_lengths(num: int, median: int, sigma: float, max_len: int,
                      rng: np.random.Generator) -> np.ndarray:
  lengths = rng.lognormal(np.log(median), sigma, size=num)
  return np.clip(np.round(lengths), 1, max_len).astype(int)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = cli.load_config(_CONFIG)
  model, rng = config.model, np.random.default_rng(_SEED.value)
  rows = []
  print(f"decode attention, one layer: {model.name} dims ({model.num_heads} heads, "
        f"{model.num_kv_heads} KV heads, head_dim {model.head_dim}), {model.dtype}, "
        f"page size {_PAGE_SIZE.value}, {jax.devices()[0].platform}, jax {jax.__version__}, "
        f"median of {_REPEATS.value} calls x 5 interleaved rounds")
  print(f"{'batch':>6} {'context':>8} {'paged ms':>10} {'fast ms':>8} {'contig ms':>10} "
        f"{'ratio':>6} {'fast ratio':>10} {'fast GB/s':>10} {'contig GB/s':>12}")
  for batch in map(int, _BATCHES.value):
    for context in map(int, _CONTEXTS.value):
      row = time_decode(batch, context, model, _PAGE_SIZE.value, _REPEATS.value, rng)
      rows.append(row)
      print(f"{batch:>6} {context:>8} {row['paged_ms']:>10.3f} {row['fast_ms']:>8.3f} "
            f"{row['contiguous_ms']:>10.3f} {row['ratio']:>6.2f} {row['fast_ratio']:>10.2f} "
            f"{row['fast_gb_per_s']:>10.2f} {row['contiguous_gb_per_s']:>12.2f}")

  lengths = lognormal_lengths(_NUM_SEQS.value, _MEDIAN_LEN.value, _SIGMA.value,
                              _MAX_LEN.value, rng)
  per_token = model_shape.kv_bytes_per_token(model_shape.ModelShape.from_config(model), model.dtype)
  frag = capacity.fragmentation(lengths.tolist(), max_len=_MAX_LEN.value,
                                page_size=_PAGE_SIZE.value, kv_bytes_per_token=per_token)
  print(f"\nfragmentation: {len(lengths):,} sequences, lognormal(median {_MEDIAN_LEN.value}, "
        f"sigma {_SIGMA.value}) capped at {_MAX_LEN.value}; observed median "
        f"{int(np.median(lengths))}, mean {lengths.mean():.0f}, max {lengths.max()}")
  print(f"{'scheme':>12} {'reserved tokens':>16} {'holds real tokens':>18} {'waste':>8}")
  print(f"{'paged':>12} {frag.paged_reserved_tokens:>16,} {frag.paged_utilization:>18.2%} "
        f"{frag.paged_waste:>8.2%}")
  print(f"{'contiguous':>12} {frag.contiguous_reserved_tokens:>16,} "
        f"{frag.contiguous_utilization:>18.2%} {frag.contiguous_waste:>8.2%}")

  record = dict(
      benchmark="attention_cpu", premises=dict(
          model=model.name, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
          head_dim=model.head_dim, dtype=model.dtype, page_size=_PAGE_SIZE.value,
          device=str(jax.devices()[0]), repeats=_REPEATS.value, seed=_SEED.value,
          length_mix=dict(distribution="lognormal", median=_MEDIAN_LEN.value,
                          sigma=_SIGMA.value, max_len=_MAX_LEN.value, num=_NUM_SEQS.value),
          **premises.environment()),
      decode=rows, fragmentation=vars(frag))
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=2)
  print(f"\nwrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
