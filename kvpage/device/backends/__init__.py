"""The backends seam: which code computes a model's ops, chosen once from its run choices.

A model is written against `Ops`: attention over the paged cache, its products (a
layer's projections of one input, the SwiGLU MLP, each with the RMSNorm before and the
residual add after), and RMSNorm alone. Which code computes them is a run choice, not
the model's business: three of them, in a config's model section (`RunChoices`):

  * `attention_impl`: `xla` (the XLA paths, `xla/attention.py`), `cpu` (the same with
    decode rows and prompt chunks on the native kernels, `cpu/`), `reference` (the
    oracle, `kvpage.device.attention.reference`), `pallas` (the Triton kernels,
    `pallas/`) or `mosaic` (the same with the Mosaic GPU decode kernel); the GPU kernels
    run interpreted when JAX's backend is the CPU;
  * `linear_impl`: `xla` or `cpu` (the native products, XLA where they do not run);
  * `matmul_precision`: JAX's names (`jax.lax.Precision`): `default`, `high`, `highest`.

This module is the one place that maps those names to code: `check` validates them
(with the config, `configs.base.check`), `ops` hands a model the chosen backends' ops,
`traits` their cost traits (what the executor, the calibration and the memory plan
ask, instead of naming a backend) and `describe` what actually runs here, for the run
records. Each backend lives in its own folder beside this file and names no other but
the XLA one it builds on.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections

from kvpage.device import cache as paged_cache
from kvpage.device import sharding
from kvpage.device.attention import reference
from kvpage.device.backends import cpu, xla
from kvpage.device.backends.cpu import native
from kvpage.device.sharding import TensorParallel
from kvpage.interface import CostTraits

ATTENTION_IMPLS = ("xla", "cpu", "reference", "pallas", "mosaic")
LINEAR_IMPLS = ("xla", "cpu")
MATMUL_PRECISIONS = ("default", "high", "highest")


@dataclasses.dataclass(frozen=True)
class RunChoices:
  """How a model runs: its hardware's choice, which a checkpoint does not carry. Each
  field is checked against its names when the record is made."""

  attention_impl: str = "xla"
  linear_impl: str = "xla"
  matmul_precision: str = "default"

  def __post_init__(self):
    for name, choices in (("attention_impl", ATTENTION_IMPLS), ("linear_impl", LINEAR_IMPLS),
                          ("matmul_precision", MATMUL_PRECISIONS)):
      value = getattr(self, name)
      if value not in choices:
        raise ValueError(f"{name} {value!r}: choose one of {', '.join(choices)}")

  @classmethod
  def of(cls, model_config: ml_collections.ConfigDict) -> "RunChoices":
    """The choices of a model section; a field it leaves out takes its default."""
    return cls(**{field.name: model_config.get(field.name, field.default)
                  for field in dataclasses.fields(cls)})

  def write(self, model_config: ml_collections.ConfigDict) -> None:
    """Sets these choices in a model section (a checkpoint's, run as a config says)."""
    for field in dataclasses.fields(self):
      model_config[field.name] = getattr(self, field.name)

  @property
  def precision(self) -> jax.lax.Precision | None:
    """`jax.lax.dot_general`'s argument; None defers to `jax_default_matmul_precision`."""
    if self.matmul_precision == "default":
      return None
    return jax.lax.Precision(self.matmul_precision)


def check(model_config: ml_collections.ConfigDict) -> RunChoices:
  """A model section's run choices; raises `ValueError` naming the first bad one."""
  return RunChoices.of(model_config)


AttentionFn = Callable[..., jax.Array]


def _reference_attention(q, k_pages, v_pages, *, layer, page_tables, context_lens,
                         query_start_loc, decode_only, precision=None):
  del decode_only, precision  # the oracle serves every batch, in fp32
  return reference.ragged_paged_attention(q, k_pages[layer], v_pages[layer],
                                          page_tables=page_tables, context_lens=context_lens,
                                          query_start_loc=query_start_loc)


def _attention_fn(impl: str) -> AttentionFn:
  if impl == "xla":
    return xla.attend
  if impl == "cpu":
    return cpu.attend
  if impl == "reference":
    return _reference_attention
  from kvpage.device.backends import pallas  # Imported only when chosen.

  return functools.partial(pallas.attend, decode_kernel="mosaic" if impl == "mosaic"
                           else "triton")


class Ops:
  """The ops a model calls, computed by the backends `choices` name, on one device or
  split over `tensor_parallel`'s mesh."""

  def __init__(self, choices: RunChoices, tensor_parallel: TensorParallel | None = None):
    self.choices = choices
    self.precision = choices.precision
    self.tensor_parallel = tensor_parallel
    self._attention = _attention_fn(choices.attention_impl)
    self._linear = (cpu.products(self.precision, tensor_parallel)
                    if choices.linear_impl == "cpu"
                    else xla.Linear(self.precision, tensor_parallel))

  def attention(self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, layer: int,
                page_tables: jax.Array, context_lens: jax.Array, query_start_loc: jax.Array,
                decode_only: bool) -> jax.Array:
    """One layer's causal attention of a step's new tokens over the paged cache.

    Args:
      q: `[num_tokens, num_heads, head_dim]`, in the cache's dtype.
      k_pages, v_pages: the whole cache, `[num_layers, num_kv_heads, num_pages,
        page_size, head_dim]`; `xla` and `cpu` read layer `layer` in place, the others
        a slice.
      layer: the layer to attend over (static).
      page_tables, context_lens, query_start_loc: as in
        `reference.ragged_paged_attention`.
      decode_only: a static Python bool: every sequence brings exactly one new token,
        token `s` being sequence `s`'s.
    Returns:
      `[num_tokens, num_heads, head_dim]` in `q.dtype`. Under tensor parallelism each
      device attends with its own heads (`sharding.shard_attention`).
    """
    if not isinstance(decode_only, bool):
      # A traced flag cannot pick a code path at trace time; the batch's type carries it.
      raise TypeError(f"decode_only must be a static Python bool, got {type(decode_only)}")

    def one_device(q, k_pages, v_pages, page_tables, context_lens, query_start_loc):
      return self._attention(q, k_pages, v_pages, layer=layer, page_tables=page_tables,
                             context_lens=context_lens, query_start_loc=query_start_loc,
                             decode_only=decode_only, precision=self.precision)

    if self.tensor_parallel is not None:
      one_device = sharding.shard_attention(one_device, self.tensor_parallel)
    return one_device(q, k_pages, v_pages, page_tables, context_lens, query_start_loc)

  def project(self, x: jax.Array, weights: Sequence[jax.Array], *,
              norm: tuple[jax.Array, float] | None = None,
              residual: jax.Array | None = None) -> list[jax.Array]:
    """`[x @ w for w in weights]` for `x` [..., K] and each `w` [K, N_i]; with `norm`
    (scale, eps), of `rms_norm(x)`; with `residual` (one weight only), plus the result
    made whole across devices (the all-reduce of a row-parallel projection)."""
    return self._linear.project(x, weights, norm=norm, residual=residual)

  def swiglu(self, x: jax.Array, gate: jax.Array, up: jax.Array, *,
             norm: tuple[jax.Array, float] | None = None) -> jax.Array:
    """`silu(x @ gate) * (x @ up)`, of `rms_norm(x)` with `norm`."""
    return self._linear.swiglu(x, gate, up, norm=norm)

  def rms_norm(self, x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Llama's RMSNorm alone (where no product follows to apply it)."""
    return xla.rms_norm(x, scale, eps)


def ops(model_config: ml_collections.ConfigDict,
        tensor_parallel: TensorParallel | None = None) -> Ops:
  """The ops of a model section's run choices (`check`ed with the config)."""
  return Ops(RunChoices.of(model_config), tensor_parallel)


def traits(model_config: ml_collections.ConfigDict, *, kv_dtype: Any = None,
           tensor_parallel: int = 1, choices: RunChoices | None = None) -> CostTraits:
  """The cost traits of the backends a model section chooses (or `choices`), for its
  cache's `kv_dtype` (default: the model's) on `tensor_parallel` devices."""
  choices = choices or RunChoices.of(model_config)
  attention_impl = choices.attention_impl
  if attention_impl == "cpu" or choices.linear_impl == "cpu":
    kv_dtype = paged_cache.jnp_dtype(kv_dtype or model_config.dtype)
    group = model_config.num_heads // model_config.num_kv_heads
    base = cpu.traits(attention=attention_impl == "cpu", linear=choices.linear_impl == "cpu",
                      kv_dtype=kv_dtype, group=group, head_dim=model_config.head_dim,
                      tensor_parallel=tensor_parallel)
  else:
    base = xla.traits()
  # Only the XLA decode pass pads every row to the longest; the oracle and the Pallas
  # kernels read each row's own context.
  reads_longest = base.decode_reads_longest and attention_impl in ("xla", "cpu")
  return dataclasses.replace(base, decode_reads_longest=reads_longest)


def transfer_guard(model_config: ml_collections.ConfigDict) -> str:
  """The executor's transfer-guard level for a model section's backends: "disallow",
  except where Mosaic GPU's interpreter runs (the `mosaic` choice on CPU), which moves
  scalars to the device inside its own callbacks: the guard would refuse them, so
  there it only logs."""
  interpreted_mosaic = (RunChoices.of(model_config).attention_impl == "mosaic"
                        and jax.default_backend() == "cpu")
  return "log" if interpreted_mosaic else "disallow"


def describe(model_config: ml_collections.ConfigDict, *, kv_dtype: Any = None,
             tensor_parallel: int = 1) -> dict[str, Any]:
  """What computes each op here, for a run's records (`summary.json`, the server's
  log and `/v1/models`): per op the backend that actually runs it (a native kernel
  that did not load, or does not take these shapes, leaves its op on XLA), the native
  library's state and instruction-set variant, and the precision."""
  choices = RunChoices.of(model_config)
  device = jax.default_backend()
  attention = {"xla": "xla", "reference": "reference (the oracle)",
               "pallas": "pallas (Triton)", "mosaic": "pallas (Mosaic GPU decode)"}.get(
                   choices.attention_impl, "")
  if choices.attention_impl in ("pallas", "mosaic") and device == "cpu":
    attention += ", interpreted"
  if choices.attention_impl == "cpu":
    attention = cpu.describe_attention(
        paged_cache.jnp_dtype(kv_dtype or model_config.dtype),
        model_config.num_heads // model_config.num_kv_heads, model_config.head_dim)
  linear = "xla"
  if choices.linear_impl == "cpu":
    linear = cpu.describe_products(paged_cache.jnp_dtype(model_config.dtype),
                                   choices.precision, tensor_parallel)
  record = dict(attention_impl=choices.attention_impl, linear_impl=choices.linear_impl,
                matmul_precision=choices.matmul_precision, attention=attention,
                linear=linear, device=device)
  if "cpu" in (choices.attention_impl, choices.linear_impl):
    record["native"] = native.describe()
  return record
