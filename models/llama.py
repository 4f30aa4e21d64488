"""A Llama-family decoder over kvpage's paged KV cache, in Flax (linen).

RMSNorm, rotary embeddings (optionally Llama 3 scaled), grouped-query attention,
SwiGLU, tied or untied embeddings — Llama 2 and 3 (Touvron et al. 2023; Meta 2024).
Parameter names mirror Hugging Face's `LlamaForCausalLM` so `models.hf` maps a
checkpoint by name.

The forward pass serves one ragged mixed batch (`kvpage.batch.StepBatch`): prefill
chunks and decode tokens flattened to `[num_tokens]`. Each layer writes its new keys
and values into the cache through the slot mapping, then attends through the page
tables. The model computes through ops (`kvpage.device.backends.Ops`: attention over
the paged cache, projections, SwiGLU, RMSNorm) and names no backend: which code runs
them is the config's run choices (`attention_impl`, `linear_impl`, `matmul_precision`;
`kvpage.device.backends.RunChoices`). Only the rows that sample (`logits_indices`) go
through the LM head. Each block takes the residual stream and its norm's scale and
returns the stream with its output added, so a backend can apply the norm and add the
residual inside its products.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from kvpage import batch as batch_lib
from kvpage.device import backends, sharding
from kvpage.device import cache as paged_cache
from kvpage.device.sharding import TensorParallel
from models import rope


class NormScale(nn.Module):
  """An RMSNorm's scale (`weight`, ones at init), for `Ops.rms_norm` or a product that
  applies the norm itself."""

  dtype: Any

  @nn.compact
  def __call__(self, features: int) -> jax.Array:
    return self.param("weight", nn.initializers.ones, (features,), self.dtype)


class Weight(nn.Module):
  """The `[in_features, features]` kernel of a bias-free projection: `nn.Dense`'s
  parameter, by its name and init, for the products below to compute."""

  features: int
  dtype: Any

  @nn.compact
  def __call__(self, in_features: int) -> jax.Array:
    return self.param("kernel", nn.initializers.normal(0.02), (in_features, self.features),
                      self.dtype)


class Attention(nn.Module):
  config: ml_collections.ConfigDict
  layer: int
  tensor_parallel: TensorParallel | None = None

  @nn.compact
  def __call__(self, x: jax.Array, cache: paged_cache.PagedKVCache,
               batch: batch_lib.StepBatch, norm: tuple[jax.Array, float]
               ) -> tuple[jax.Array, paged_cache.PagedKVCache]:
    """The residual stream `x` plus attention over `rms_norm(x)` (`norm`: scale, eps)."""
    c, dtype = self.config, paged_cache.jnp_dtype(self.config.dtype)
    tp, num_tokens = self.tensor_parallel, x.shape[0]
    ops = backends.ops(c, tp)
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q, k, v = ops.project(x, [
        Weight(q_dim, dtype, name="q_proj")(c.d_model),
        Weight(kv_dim, dtype, name="k_proj")(c.d_model),
        Weight(kv_dim, dtype, name="v_proj")(c.d_model)], norm=norm)
    q = q.reshape(num_tokens, c.num_heads, c.head_dim)
    k = k.reshape(num_tokens, c.num_kv_heads, c.head_dim)
    v = v.reshape(num_tokens, c.num_kv_heads, c.head_dim)
    inv_freq = rope.inverse_frequencies(c.head_dim, c.rope_theta, c.get("rope_scaling"))
    q = rope.apply(q, batch.positions, inv_freq)
    k = rope.apply(k, batch.positions, inv_freq)
    # Each device computes its own heads (a no-op without a mesh).
    q = sharding.constrain(q, tp, "heads")
    k = sharding.constrain(k, tp, "kv_heads")
    v = sharding.constrain(v, tp, "kv_heads")
    cache = paged_cache.write(cache, self.layer, k, v, batch.slot_mapping)
    # `decode_only` is a class attribute of the batch's type, so static under jit.
    out = ops.attention(q.astype(cache.dtype), cache.k_pages, cache.v_pages,
                        layer=self.layer, page_tables=batch.page_tables,
                        context_lens=batch.context_lens,
                        query_start_loc=batch.query_start_loc, decode_only=batch.decode_only)
    out = out.astype(dtype).reshape(num_tokens, q_dim)
    # Each device's heads project to a partial sum, all-reduced before the residual.
    (x,) = ops.project(out, [Weight(c.d_model, dtype, name="o_proj")(q_dim)], residual=x)
    return x, cache


class MLP(nn.Module):
  config: ml_collections.ConfigDict
  tensor_parallel: TensorParallel | None = None

  @nn.compact
  def __call__(self, x: jax.Array, norm: tuple[jax.Array, float]) -> jax.Array:
    """The residual stream `x` plus the MLP of `rms_norm(x)` (`norm`: scale, eps)."""
    c, tp, dtype = self.config, self.tensor_parallel, paged_cache.jnp_dtype(self.config.dtype)
    ops = backends.ops(c, tp)
    hidden = ops.swiglu(x, Weight(c.ffn_dim, dtype, name="gate_proj")(c.d_model),
                        Weight(c.ffn_dim, dtype, name="up_proj")(c.d_model), norm=norm)
    (x,) = ops.project(hidden, [Weight(c.d_model, dtype, name="down_proj")(c.ffn_dim)],
                       residual=x)  # all-reduced before the residual
    return x


class DecoderLayer(nn.Module):
  config: ml_collections.ConfigDict
  layer: int
  tensor_parallel: TensorParallel | None = None

  @nn.compact
  def __call__(self, x, cache, batch):
    c, dtype = self.config, paged_cache.jnp_dtype(self.config.dtype)
    tp = self.tensor_parallel
    # Each block adds to the residual stream; its RMSNorm is applied by its products.
    x, cache = Attention(c, self.layer, tp, name="self_attn")(
        x, cache, batch, (NormScale(dtype, name="input_layernorm")(c.d_model), c.norm_eps))
    x = MLP(c, tp, name="mlp")(
        x, (NormScale(dtype, name="post_attention_layernorm")(c.d_model), c.norm_eps))
    return x, cache


class Llama(nn.Module):
  """`(token ids, cache, batch) -> (logits of the sampled rows, updated cache)`."""

  config: ml_collections.ConfigDict
  tensor_parallel: TensorParallel | None = None

  @nn.compact
  def __call__(self, cache: paged_cache.PagedKVCache,
               batch: batch_lib.StepBatch) -> tuple[jax.Array, paged_cache.PagedKVCache]:
    c, dtype = self.config, paged_cache.jnp_dtype(self.config.dtype)
    embed = nn.Embed(c.vocab_size, c.d_model, dtype=dtype, param_dtype=dtype,
                     embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
    tp = self.tensor_parallel
    x = sharding.constrain(embed(batch.token_ids), tp, "replicated")
    for layer in range(c.num_layers):
      x, cache = DecoderLayer(c, layer, tp, name=f"layers_{layer}")(x, cache, batch)
    ops = backends.ops(c, tp)
    x = ops.rms_norm(x[batch.logits_indices], NormScale(dtype, name="norm")(c.d_model),
                     c.norm_eps)
    logits = (embed.attend(x) if c.tie_embeddings else ops.project(
        x, [Weight(c.vocab_size, dtype, name="lm_head")(c.d_model)])[0])
    # Each device scores its slice of the vocabulary; the sampler gets whole logits on
    # every device: one gather of `[num_seqs, vocab]`, not of the LM head's weights.
    logits = sharding.constrain(logits.astype(jnp.float32), tp, "vocab")
    logits = sharding.constrain(logits, tp, "replicated")
    return logits, cache


def forward(params: Any, cache: paged_cache.PagedKVCache, batch: batch_lib.StepBatch, *,
            config: ml_collections.ConfigDict,
            tensor_parallel: TensorParallel | None = None
            ) -> tuple[jax.Array, paged_cache.PagedKVCache]:
  """The step's model function: `f32[num_seqs, vocab]` logits and the updated cache;
  with `tensor_parallel`, sharded over its mesh (`params` and `cache` placed by
  `param_axes` and `TensorParallel.cache`)."""
  return Llama(config, tensor_parallel).apply({"params": params}, cache, batch)


_PARAM_AXES = {
    "embed_tokens": ("vocab", None), "lm_head": (None, "vocab"),
    "q_proj": (None, "heads"), "k_proj": (None, "kv_heads"), "v_proj": (None, "kv_heads"),
    "o_proj": ("heads", None),
    "gate_proj": (None, "ffn"), "up_proj": (None, "ffn"), "down_proj": ("ffn", None),
}


def param_axes(path: tuple[str, ...]) -> tuple[str | None, ...]:
  """Logical names of a parameter's dimensions (`kvpage.device.sharding.LOGICAL_AXES`),
  by its path in `params`: Megatron's split (q/k/v and gate/up by output features, o and
  down by input features) and the vocabulary split across devices (embedding rows, LM
  head columns), which for a 128k vocabulary is gigabytes a device does not hold twice.
  Norm scales stay whole."""
  return _PARAM_AXES.get(path[-2], (None,))


def random_init(config: ml_collections.ConfigDict, seed: int = 0) -> Any:
  """Random parameters for `config` (a model section), so any config runs without weights."""
  example = batch_lib.example_batch(num_tokens=1, num_seqs=1, max_pages_per_seq=1)
  cache = paged_cache.init(config, num_pages=2, page_size=1)
  variables = jax.jit(Llama(config).init)(jax.random.PRNGKey(seed), cache, example)
  return variables["params"]
