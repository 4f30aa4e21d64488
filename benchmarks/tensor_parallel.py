r"""Tensor parallelism: real step times at TP 1/2/4 on CPU, simulated ones at TP 1-8 on GPUs.

  python -m benchmarks.tensor_parallel --out=tensor_parallel.json

1. **Real, on this machine.** The tiny Llama (or `--config`) on 4 CPU devices
   (`--xla_force_host_platform_device_count=4`, set here before JAX starts): for each
   tensor-parallel degree, the median time of a decode step (`--batch` sequences at
   `--context` tokens) and of a prefill step (`--prefill_tokens` tokens in 4 prompts),
   each through the real jitted step with the cache donated, and what one device holds
   of the weights and of the KV pool (from the arrays' shardings). CPU "devices" share
   the same cores and memory, so expect no speed-up: the point is that it runs, and
   what each device holds.
2. **Simulated.** The simulator's predicted step times (`kvpage.sim.step_model`, each
   config's hardware entry and its calibration or template rates) at TP 1/2/4/8 for
   Llama 2 13B and Llama 2 70B: a decode step of 32 sequences at 1,024 tokens of
   context, and a 2,048-token prefill; each part (linear layers, attention, the two
   all-reduces per layer) and what one device holds.

Premises: fp32 tiny model (4 layers, d_model 256, 4:2 heads), page size 16, greedy,
XLA:CPU; fp16 GPU models as in `configs/`. Prints tables and writes JSON with versions.
"""

import os

# Before JAX starts: the CPU backend's device count is fixed when it first initializes.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import json

import jax
import numpy as np
from absl import app, flags

from benchmarks import timing
from configs import hardware as hardware_lib
from configs import llama2_70b, llama_13b
from experiments import cli
from kvpage import batch as batch_lib
from kvpage import build, model_shape, premises, sizing
from kvpage.device import sharding
from models import llama

_CONFIG = cli.define_config("configs/tiny.py", "Model for the real part.")
_OUT = flags.DEFINE_string("out", "tensor_parallel.json", "Where to write the JSON record.")
_BATCH = flags.DEFINE_integer("batch", 16, "Sequences in the real decode step.")
_CONTEXT = flags.DEFINE_integer("context", 256, "Context of each decode sequence (tokens).")
_PREFILL = flags.DEFINE_integer("prefill_tokens", 512, "Tokens of the real prefill step.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed steps per case (median reported).")

SIMULATED = (llama_13b, llama2_70b)
SIM_DEGREES = (1, 2, 4, 8)
SIM_DECODE = (32, 1024)  # sequences, context
SIM_PREFILL = 2048


def _decode_batch(num_seqs: int, context: int, page_size: int, width: int):
  """A decode step of `num_seqs` sequences at `context`, on distinct pages from 1 on."""
  pages = -(-context // page_size)
  tables = np.zeros((num_seqs, width), np.int32)
  tables[:, :pages] = 1 + np.arange(num_seqs * pages).reshape(num_seqs, pages)
  batch = batch_lib.example_batch(num_seqs, num_seqs, width, decode_only=True)
  last = context - 1
  return batch._replace(
      page_tables=tables, context_lens=np.full(num_seqs, context, np.int32),
      positions=np.full(num_seqs, last, np.int32),
      slot_mapping=tables[:, last // page_size] * page_size + last % page_size)


def _prefill_batch(num_tokens: int, num_seqs: int, page_size: int, width: int):
  """`num_seqs` fresh prompts of `num_tokens / num_seqs` tokens each."""
  length = num_tokens // num_seqs
  pages = -(-length // page_size)
  tables = np.zeros((num_seqs, width), np.int32)
  tables[:, :pages] = 1 + np.arange(num_seqs * pages).reshape(num_seqs, pages)
  positions = np.tile(np.arange(length, dtype=np.int32), num_seqs)
  rows = np.repeat(np.arange(num_seqs), length)
  batch = batch_lib.example_batch(num_tokens, num_seqs, width, decode_only=False)
  return batch._replace(
      token_ids=(np.arange(num_tokens, dtype=np.int32) % 97) + 1, positions=positions,
      slot_mapping=tables[rows, positions // page_size] * page_size + positions % page_size,
      page_tables=tables, context_lens=np.full(num_seqs, length, np.int32),
      query_start_loc=np.arange(num_seqs + 1, dtype=np.int32) * length,
      logits_indices=np.arange(1, num_seqs + 1, dtype=np.int32) * length - 1)


def real_case(config, tensor_parallel: int) -> dict:
  model = config.model
  page_size = config.cache.page_size
  num_pages = 2 + max(_BATCH.value * -(-_CONTEXT.value // page_size),
                      -(-_PREFILL.value // page_size) + 4)
  params = llama.random_init(model, config.seed)
  engine = build.jax_engine(llama, model, params, config.scheduler, num_pages=num_pages,
                            page_size=page_size, tensor_parallel=tensor_parallel)
  executor = engine.executor
  width = -(-max(_CONTEXT.value, _PREFILL.value) // page_size)
  batches = dict(decode=_decode_batch(_BATCH.value, _CONTEXT.value, page_size, width),
                 prefill=_prefill_batch(_PREFILL.value, 4, page_size, width))
  times = {}
  for name, batch in batches.items():
    def step(batch=batch):
      tokens, executor.cache = executor.step.dispatch(executor.params, executor.cache, batch,
                                                      True)
      tokens.block_until_ready()
    times[f"{name}_ms"] = 1e3 * timing.time_call(step, repeats=_REPEATS.value)["median_s"]
  weights = sharding.device_bytes(executor.params)
  pool = sharding.device_bytes(executor.cache)
  return dict(tensor_parallel=tensor_parallel, **times,
              weight_bytes_per_device=max(weights.values()),
              kv_pool_bytes_per_device=max(pool.values()),
              kv_pool_bytes=executor.cache.num_bytes, compiles=executor.num_compiles)


def simulated_case(module, tensor_parallel: int) -> dict:
  config = module.get_config()
  config.mesh.tensor_parallel = tensor_parallel
  hardware = hardware_lib.get_hardware(config.hardware)
  rates, source = build.step_rates(hardware, config.sim.calibration)
  step_model = build.step_model(config, rates, hardware)
  batch, context = SIM_DECODE
  decode = step_model.step_cost([(1, context)] * batch)
  prefill = step_model.step_cost([(SIM_PREFILL, SIM_PREFILL)])
  shape = model_shape.ModelShape.from_config(config.model)
  try:
    pages = sizing.sim_memory_plan(config, hardware).num_pages
  except ValueError:  # the weights alone overflow one device: no KV pool at all
    pages = 0
  return dict(model=config.model.name, hardware=hardware.name, rates=source,
              tensor_parallel=tensor_parallel,
              decode_ms=1e3 * decode.seconds, prefill_ms=1e3 * prefill.seconds,
              decode_parts_ms={k: 1e3 * v for k, v in decode.parts.items()},
              prefill_parts_ms={k: 1e3 * v for k, v in prefill.parts.items()},
              weight_bytes_per_device=-(-model_shape.weight_bytes(shape, config.model.dtype)
                                        // tensor_parallel),
              kv_heads_per_device=model_shape.kv_heads_per_device(shape, tensor_parallel),
              kv_pages_per_device=pages)  # 0: the model does not fit


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = cli.load_config(_CONFIG)
  degrees = [tp for tp in (1, 2, 4) if tp <= jax.device_count()]
  real = [real_case(config, tp) for tp in degrees]
  simulated = [simulated_case(module, tp) for module in SIMULATED for tp in SIM_DEGREES]
  mib = 2**20
  print(f"Real steps on {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"{config.model.name} {config.model.dtype}: decode {_BATCH.value} seqs x "
        f"{_CONTEXT.value} tokens, prefill {_PREFILL.value} tokens (4 prompts)")
  print(f"{'TP':>3} {'decode ms':>10} {'prefill ms':>11} {'weights/dev MiB':>16} "
        f"{'KV pool/dev MiB':>16} {'of MiB':>8}")
  for row in real:
    print(f"{row['tensor_parallel']:>3} {row['decode_ms']:>10.2f} {row['prefill_ms']:>11.2f} "
          f"{row['weight_bytes_per_device'] / mib:>16.2f} "
          f"{row['kv_pool_bytes_per_device'] / mib:>16.2f} {row['kv_pool_bytes'] / mib:>8.2f}")
  batch, context = SIM_DECODE
  print(f"\nSimulated steps: decode {batch} seqs x {context} tokens, prefill {SIM_PREFILL} "
        "tokens")
  print(f"{'model':<12} {'hardware':<12} {'TP':>3} {'decode ms':>10} {'(all-reduce)':>13} "
        f"{'prefill ms':>11} {'(all-reduce)':>13} {'weights/dev GiB':>16} {'KV pages/dev':>13}")
  for row in simulated:
    print(f"{row['model']:<12} {row['hardware']:<12} {row['tensor_parallel']:>3} "
          f"{row['decode_ms']:>10.2f} {row['decode_parts_ms']['allreduce']:>13.2f} "
          f"{row['prefill_ms']:>11.2f} {row['prefill_parts_ms']['allreduce']:>13.2f} "
          f"{row['weight_bytes_per_device'] / 2**30:>16.2f} "
          f"{row['kv_pages_per_device'] or 'does not fit':>13}")
  record = dict(premises=dict(
      real=dict(model=config.model.to_dict(), page_size=config.cache.page_size,
                batch=_BATCH.value, context=_CONTEXT.value, prefill_tokens=_PREFILL.value,
                prefill_prompts=4, repeats=_REPEATS.value, greedy=True,
                devices=f"{jax.device_count()} x {jax.devices()[0].platform}",
                xla_flags=os.environ.get("XLA_FLAGS", "")),
      simulated=dict(decode=dict(sequences=batch, context=context), prefill_tokens=SIM_PREFILL),
      environment=premises.environment()),
      real=real, simulated=simulated)
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=2)
  print(f"\nwrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
