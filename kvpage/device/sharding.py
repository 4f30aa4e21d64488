"""Tensor parallelism: a device mesh, Megatron-style shardings, and attention per shard.

A step runs on `tensor_parallel` devices (Megatron-LM, Shoeybi et al. 2019). The mesh
has two axes:

  * `kv` splits the KV heads: `min(num_kv_heads, tensor_parallel)` groups;
  * `rep` replicates each KV head over the devices that share it, when KV heads are
    fewer than devices (vLLM's rule): `tensor_parallel // kv` devices per head.

Query heads and FFN features split over both axes together (`MODEL_AXES`), in the
mesh's device order, so device `(a, b)` holds query-head block `a * rep + b`: exactly
the heads that read KV head group `a`, the one it holds (grouped-query attention puts
query head `h` on KV head `h // group`). Attention therefore needs no communication;
the two all-reduces per layer come after the attention output projection and after
the MLP's down projection, where XLA inserts them because the residual stream is
annotated as replicated.

A model names each parameter's dimensions with the logical axes of `LOGICAL_AXES`
(`heads`, `kv_heads`, `ffn`, `vocab`); `param_shardings` maps them onto the mesh.
The KV cache splits on its KV-head axis (`[num_layers, num_kv_heads, ...]`), so every
device holds its heads' slice of every page: the pages, the page tables and the host
scheduler are the same on every shard, and only the bytes per page shrink.

Attention implementations (the XLA paths, the oracle, the Pallas kernels) are written
for one device's heads; `shard_attention` runs one under `jax.shard_map`, on each
device's query heads and KV-head slice.

Across processes (`kvpage.device.multihost`), the mesh spans every process's devices;
nothing here changes.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

KV_AXIS = "kv"
REPLICA_AXIS = "rep"
MODEL_AXES = (KV_AXIS, REPLICA_AXIS)

# Logical dimension names a model gives its parameters, and the mesh axes they split on.
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "heads": MODEL_AXES,   # query heads (q projection outputs, o projection inputs)
    "kv_heads": (KV_AXIS,),  # key and value heads: replicated over `rep`
    "ffn": MODEL_AXES,     # MLP hidden features
    "vocab": MODEL_AXES,   # embedding rows and LM head columns
}


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """A mesh of `kv x rep` devices and the shardings a step's arrays take on it."""

  mesh: Mesh

  @property
  def size(self) -> int:
    return self.mesh.size

  def sharding(self, *spec: Any) -> NamedSharding:
    return NamedSharding(self.mesh, P(*spec))

  @property
  def replicated(self) -> NamedSharding:
    return self.sharding()

  @property
  def cache(self) -> NamedSharding:
    """The KV pool `[num_layers, num_kv_heads, num_pages, page_size, head_dim]`."""
    return self.sharding(None, KV_AXIS)

  @property
  def heads(self) -> NamedSharding:
    """Per-token query heads `[num_tokens, num_heads, head_dim]`."""
    return self.sharding(None, MODEL_AXES)

  @property
  def vocab(self) -> NamedSharding:
    """Per-row logits `[num_rows, vocab]`, as the vocabulary-split LM head makes them."""
    return self.sharding(None, MODEL_AXES)

  @property
  def kv_heads(self) -> NamedSharding:
    """Per-token keys or values `[num_tokens, num_kv_heads, head_dim]`."""
    return self.sharding(None, KV_AXIS)


def make(tensor_parallel: int, num_kv_heads: int,
         devices: Sequence[jax.Device] | None = None) -> TensorParallel:
  """The mesh for `tensor_parallel` devices (default: the first of `jax.devices()`,
  every process's in a multi-process run)."""
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) < tensor_parallel:
    raise ValueError(f"tensor_parallel={tensor_parallel} needs {tensor_parallel} devices; "
                     f"JAX sees {len(devices)} ({devices[0].platform}). On CPU, set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel}")
  kv_groups = min(num_kv_heads, tensor_parallel)
  if tensor_parallel % kv_groups or (num_kv_heads >= tensor_parallel
                                     and num_kv_heads % tensor_parallel):
    raise ValueError(f"num_kv_heads={num_kv_heads} neither splits over nor replicates "
                     f"evenly onto tensor_parallel={tensor_parallel} devices")
  grid = np.array(devices[:tensor_parallel]).reshape(kv_groups, tensor_parallel // kv_groups)
  # Auto axes: XLA propagates the shardings of the annotated arrays to the rest.
  mesh = Mesh(grid, MODEL_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)
  return TensorParallel(mesh)


def partition_spec(axes: Sequence[str | None], shape: Sequence[int],
                   tp: TensorParallel) -> P:
  """A `PartitionSpec` for a parameter whose dimensions are named `axes` (`None`: not
  split); a dimension that does not divide by the devices it would split over stays
  whole (replicated), e.g. a vocabulary of 32,001 rows."""
  spec = []
  for name, dim in zip(axes, shape, strict=True):
    mesh_axes = LOGICAL_AXES[name] if name else ()
    devices = int(np.prod([tp.mesh.shape[axis] for axis in mesh_axes]))
    spec.append(mesh_axes if mesh_axes and dim % devices == 0 else None)
  return P(*spec)


def param_shardings(params: Any, param_axes: Callable[[tuple[str, ...]], Sequence[str | None]],
                    tp: TensorParallel) -> Any:
  """A sharding for every leaf of `params`, from `param_axes(path)`: the model's logical
  names of that parameter's dimensions (`path`: the leaf's dict keys)."""
  def one(path, leaf):
    names = tuple(str(getattr(key, "key", key)) for key in path)
    return NamedSharding(tp.mesh, partition_spec(param_axes(names), leaf.shape, tp))
  return jax.tree_util.tree_map_with_path(one, params)


def constrain(x: jax.Array, tp: "TensorParallel | None", sharding_name: str) -> jax.Array:
  """`x` annotated with `tp`'s sharding `sharding_name` (a no-op without a mesh, or
  where a split dimension does not divide, as `partition_spec` leaves it whole)."""
  if tp is None:
    return x
  target = getattr(tp, sharding_name)
  for dim, axes in zip(x.shape, target.spec, strict=False):
    names = (axes,) if isinstance(axes, str) else axes or ()
    if dim % int(np.prod([tp.mesh.shape[name] for name in names])):
      return x
  return jax.lax.with_sharding_constraint(x, target)


def shard_attention(fn: Callable[..., jax.Array], tp: TensorParallel) -> Callable[..., jax.Array]:
  """`fn(q, k_pages, v_pages, page_tables, context_lens, query_start_loc)` run on each
  device's heads: `q [num_tokens, num_heads, head_dim]` split by query heads, the
  pools `[num_layers, num_kv_heads, ...]` by KV heads, the batch's tables whole."""
  whole = P()
  return jax.shard_map(
      fn, mesh=tp.mesh,
      in_specs=(tp.heads.spec, tp.cache.spec, tp.cache.spec, whole, whole, whole),
      out_specs=tp.heads.spec,
      # The Pallas kernels' outputs carry no replication type for the checker to verify.
      check_vma=False)


def host_shards(array: jax.Array) -> list[tuple[tuple[slice, ...], np.ndarray]]:
  """This process's shards of `array` on the host, each with its index into the whole
  (a shard replicated on several devices is copied once): an explicit transfer that
  works whether or not other processes hold the rest."""
  shards, seen = [], set()
  for shard in array.addressable_shards:
    if repr(shard.index) not in seen:
      seen.add(repr(shard.index))
      shards.append((shard.index, jax.device_get(shard.data)))
  return shards


def device_bytes(tree: Any) -> dict[Any, int]:
  """Bytes each device holds of the arrays in `tree` (its addressable shards)."""
  held: dict[Any, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return held
