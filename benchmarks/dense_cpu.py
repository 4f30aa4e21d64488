r"""The dense layers of one step on this CPU: XLA, XLA as two halves, the CPU kernels, torch.

  python -m benchmarks.dense_cpu --out=dense_cpu.json                  # rows 32, 64, 2,048
  python -m benchmarks.dense_cpu --config=configs/small.py --rows=64,512
  taskset -c 0 python -m benchmarks.dense_cpu --rows=64                 # one core

A step's dense layers (per layer: RMSNorm, the q/k/v/o projections, RMSNorm, the SwiGLU
MLP, the residuals; then the final norm and the LM head over every row) cost the same
FLOPs in every framework, so they bound what any attention work can win. This times
them alone, for `--rows` token rows (a decode step's batch, or a prefill step's
tokens), on the config's dimensions with random fp32 weights. Attention is left out:
the o-projection reads the queries plus the keys and values repeated per group, a
stand-in of the right shape that reads no cache. Contenders, round-robin, best of
`--repeats` rounds of `--calls` calls each:
  * `xla`: the chain jitted, all rows in one call (what a kvpage step runs);
  * `xla halves`: the same jitted chain on half the rows, called back to back from each of
    two Python threads at once: what two data-parallel replicas of the engine, each
    stepping half the batch, would run on this machine (ms per pair of calls);
  * `cpu kernel`: the chain as a `linear_impl='cpu'` model runs it at the default
    precision: every product of at most `kvpage.device.backends.cpu.linear.MAX_ROWS` rows on the
    C++ kernel, split over all cores (q, k and v in one call; gate and up in one call
    with their SwiGLU); larger ones on XLA;
  * `cpu high`: the same at `matmul_precision='high'` (the CPU configs' choice): larger
    products on AMX in three bf16 passes where the CPU has it (else as `cpu kernel`);
  * `torch`: the same chain in torch (`--torch_threads` threads).
Before timing, every contender's output is compared with `xla`'s (fp32, tolerance
1e-4), so a wrong chain cannot time well. On the 2-core reference machine, at 64 rows
XLA took 2.40 ms on both cores and 2.50 ms under `taskset -c 0`: it does not split
products this small across cores, which is what the halves and the kernel recover.
Requires the `test` extra (torch).
"""

import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from absl import flags
from ml_collections import config_flags

from experiments import cli
from kvpage import premises
from kvpage.device.backends.cpu import linear as cpu_linear
from kvpage.device.backends.cpu import native as cpu

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Model dimensions.")
_ROWS = flags.DEFINE_list("rows", ["32", "64", "2048"], "Token rows per call.")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed rounds; each contender runs once a round.")
_CALLS = flags.DEFINE_integer("calls", 0, "Calls per round (0: about 0.1 s of work each).")
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", 2, "torch intra-op threads.")
_OUT = flags.DEFINE_string("out", "dense_cpu.json", "Where to write the JSON record.")

_EPS = 1e-6


def random_weights(model, rng: np.random.Generator) -> dict:
  """Per-layer projection matrices `[in, out]` and the LM head, scaled like an init."""
  d, q_dim, kv_dim, ffn = (model.d_model, model.num_heads * model.head_dim,
                           model.num_kv_heads * model.head_dim, model.ffn_dim)
  shapes = dict(q=(d, q_dim), k=(d, kv_dim), v=(d, kv_dim), o=(q_dim, d), gate=(d, ffn),
                up=(d, ffn), down=(ffn, d))

  def matrix(shape):
    return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

  return dict(layers=[{name: matrix(shape) for name, shape in shapes.items()}
                      for _ in range(model.num_layers)],
              head=matrix((d, model.vocab_size)))


def flops(model, rows: int) -> int:
  """Multiply-adds x 2 of the chain's matrix products for `rows` rows."""
  d, q_dim, kv_dim, ffn = (model.d_model, model.num_heads * model.head_dim,
                           model.num_kv_heads * model.head_dim, model.ffn_dim)
  per_layer = d * q_dim + 2 * d * kv_dim + q_dim * d + 3 * d * ffn
  return 2 * rows * (model.num_layers * per_layer + d * model.vocab_size)


def xla_project(h: jax.Array, weights: list) -> list:
  return [jnp.matmul(h, w) for w in weights]


def xla_swiglu(h: jax.Array, gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(h @ gate) * (h @ up)


def jax_chain(weights: dict, x: jax.Array, group: int, project=xla_project,
              swiglu=xla_swiglu) -> jax.Array:
  """The dense layers of one step over rows `x`, products by `project` (an input by a
  list of weights) and `swiglu`, as `kvpage.device.backends.cpu.linear` names them; the logits."""

  def norm(h):
    return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + _EPS)

  for w in weights["layers"]:
    q, k, v = project(norm(x), [w["q"], w["k"], w["v"]])
    x = x + project(q + jnp.tile(k + v, (1, group)), [w["o"]])[0]  # attention's stand-in
    x = x + project(swiglu(norm(x), w["gate"], w["up"]), [w["down"]])[0]
  return project(norm(x), [weights["head"]])[0]


def on_kernels(group: int, precision: str | None):
  """The chain as a `linear_impl='cpu'` model at `precision` runs it, jitted."""
  return jax.jit(lambda w, h: jax_chain(
      w, h, group, lambda a, ws: cpu_linear.project(a, ws, precision),
      lambda a, g, u: cpu_linear.swiglu(a, g, u, precision)))


def torch_chain(weights: dict, x: torch.Tensor, group: int) -> torch.Tensor:
  """`jax_chain` in torch."""

  def norm(h):
    return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + _EPS)

  for w in weights["layers"]:
    h = norm(x)
    q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
    x = x + (q + (k + v).repeat(1, group)) @ w["o"]
    h = norm(x)
    x = x + (torch.nn.functional.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
  return norm(x) @ weights["head"]


def in_two_threads(fn, first, second, calls: int = 1) -> list:
  """`fn(first)` and `fn(second)`, `calls` times each, from two Python threads at once (as
  two engine replicas would step); waits for both and returns their last outputs."""
  outputs = [None, None]

  def run(index, argument):
    for _ in range(calls):
      outputs[index] = jax.block_until_ready(fn(argument))

  threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate((first, second))]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  return outputs


def time_rows(model, weights: dict, rows: int, rng: np.random.Generator) -> dict:
  """Best and median ms per call of each contender at `rows` rows."""
  if rows % 2:
    raise ValueError(f"--rows must be even (two halves), got {rows}")
  group = model.num_heads // model.num_kv_heads
  x = rng.standard_normal((rows, model.d_model)).astype(np.float32)
  device_weights = jax.device_put(weights)
  jitted = jax.jit(lambda w, h: jax_chain(w, h, group))
  on_kernel, on_kernel_high = on_kernels(group, None), on_kernels(group, "high")
  whole, halves = jax.device_put(x), (jax.device_put(x[:rows // 2]),
                                      jax.device_put(x[rows // 2:]))
  torch_weights = dict(layers=[{k: torch.from_numpy(v) for k, v in layer.items()}
                               for layer in weights["layers"]],
                       head=torch.from_numpy(weights["head"]))
  torch_x = torch.from_numpy(x)

  def torch_call():
    with torch.inference_mode():
      return torch_chain(torch_weights, torch_x, group)

  def repeated(call):
    def calls_of(n):
      for _ in range(n):
        out = call()
      return out
    return calls_of

  # Each contender runs `n` calls back to back and returns its last output.
  contenders = {
      "xla": repeated(lambda: jax.block_until_ready(jitted(device_weights, whole))),
      "xla halves": lambda n: in_two_threads(lambda h: jitted(device_weights, h), *halves,
                                             calls=n),
      "cpu kernel": repeated(lambda: jax.block_until_ready(on_kernel(device_weights, whole))),
      "cpu high": repeated(
          lambda: jax.block_until_ready(on_kernel_high(device_weights, whole))),
      "torch": repeated(torch_call),
  }
  reference = np.asarray(contenders["xla"](1))
  for name, call in contenders.items():  # warm-up (compiles) and agreement
    out = call(2)
    out = (np.concatenate([np.asarray(o) for o in out]) if isinstance(out, list)
           else np.asarray(out))
    np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4,
                               err_msg=f"{name} disagrees with xla at {rows} rows")
  calls = _CALLS.value
  if calls <= 0:  # about 0.1 s a round per contender
    start = time.perf_counter()
    contenders["xla"](1)
    calls = max(1, int(0.1 / max(time.perf_counter() - start, 1e-6)))
  walls = {name: [] for name in contenders}
  for _ in range(_REPEATS.value):
    for name, call in contenders.items():
      start = time.perf_counter()
      call(calls)
      walls[name].append((time.perf_counter() - start) / calls)
  work = flops(model, rows)
  return dict(rows=rows, calls_per_round=calls, gflop=work / 1e9, contenders={
      name: dict(best_ms=1e3 * min(w), median_ms=1e3 * float(np.median(w)),
                 gflop_per_s=work / min(w) / 1e9) for name, w in walls.items()})


def main(argv: list[str]) -> None:
  del argv  # Unused.
  torch.set_num_threads(_TORCH_THREADS.value)
  config = cli.load_config(_CONFIG)
  m = config.model
  rng = np.random.default_rng(0)
  weights = random_weights(m, rng)
  print(f"dense layers of one step: {m.name} ({m.num_layers} layers, d_model {m.d_model}, "
        f"{m.num_heads}/{m.num_kv_heads} heads x {m.head_dim}, ffn {m.ffn_dim}, vocab "
        f"{m.vocab_size}), fp32, attention left out, CPU, torch {torch.get_num_threads()} "
        f"threads; best of {_REPEATS.value} rounds (ms per call)")
  print(f"{'rows':>6} {'GFLOP':>7} {'xla':>8} {'GF/s':>6} {'halves':>8} {'GF/s':>6} "
        f"{'kernel':>8} {'GF/s':>6} {'high':>8} {'GF/s':>6} {'torch':>8} {'GF/s':>6} "
        f"{'whole/halves':>12}")
  results = []
  for rows in map(int, _ROWS.value):
    result = time_rows(m, weights, rows, rng)
    results.append(result)
    c = result["contenders"]
    print(f"{rows:>6} {result['gflop']:>7.3f} "
          + " ".join(f"{c[n]['best_ms']:>8.3f} {c[n]['gflop_per_s']:>6.0f}"
                     for n in ("xla", "xla halves", "cpu kernel", "cpu high", "torch"))
          + f" {c['xla']['best_ms'] / c['xla halves']['best_ms']:>12.2f}", flush=True)
  record = dict(benchmark="dense_cpu", premises=dict(
      model=m.name, dims={k: m[k] for k in (
          "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
          "vocab_size")}, dtype="fp32", rows=[int(r) for r in _ROWS.value],
      chain="per layer: RMSNorm, q/k/v, o over q + repeated (k + v) (attention's stand-in), "
      "RMSNorm, SwiGLU MLP, residuals; final RMSNorm and the LM head over every row",
      cpu_kernel_max_rows=cpu_linear.MAX_ROWS, amx=cpu.amx(),
      repeats=_REPEATS.value, torch_threads=torch.get_num_threads(),
      **premises.environment()), results=results)
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=2)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
