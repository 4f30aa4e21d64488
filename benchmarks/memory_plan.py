r"""The memory plan's activation reserve: measured on the real step, estimated by the simulator.

  python -m benchmarks.memory_plan --out=memory_plan.json

1. **Measured vs estimated.** For small real models on this machine's backend, the
   reserve a real run measures (XLA's buffer assignment of the compiled largest steps,
   `kvpage.sizing.real_memory_plan`) beside the one a simulated run estimates from
   the same shapes (`kvpage.memory_plan.step_activation_bytes`), and their ratio.
   Nothing is allocated: the programs are compiled from shapes. (On XLA:CPU a bf16
   model's steps hold more than an fp32 one's, since the CPU backend computes bf16 in
   f32 and keeps both copies; the estimate prices bf16 at 2 bytes, as a GPU holds it.)
2. **Simulated plans.** Every shipped GPU config on its own hardware entry: each term
   of the plan, the pool it leaves, and the pool without the plan (all of the device's
   memory, no reserve: what the simulator assumed before it).

Premises: model configs as shipped (dtype, `max_num_seqs`, `max_num_batched_tokens`,
page size 16), `cache.memory_utilization` 0.9; the cases of part 1 vary the tiny model's
widths and the scheduler's limits. Prints a table and writes JSON with versions.
"""

import json

from absl import app, flags

from configs import hardware as hardware_lib
from configs import llama2_70b, llama3_8b, llama3_70b, llama_13b, mistral_7b, small, tiny, yi_34b
from kvpage import memory_plan, model_shape, premises, sizing
from kvpage.device import backends
from kvpage.sim import capacity
from models import llama

_OUT = flags.DEFINE_string("out", "memory_plan.json", "Where to write the JSON record.")

MEASURED_CASES = {
    "tiny": ({}, {}),
    "tiny bf16": ({"dtype": "bf16"}, {}),
    "tiny wide (d 512, ffn 1536, 8:2 heads, vocab 4096)":
        (dict(d_model=512, ffn_dim=1536, num_heads=8, vocab_size=4096), {}),
    "tiny, 256 seqs x 512 tokens": ({}, dict(max_num_seqs=256, max_num_batched_tokens=512)),
    "tiny, budget 8192": ({}, dict(max_num_batched_tokens=8192)),
    "small": (None, {}),
}
SIMULATED = (llama3_8b, mistral_7b, llama_13b, yi_34b, llama2_70b, llama3_70b)


def measured_case(model: dict | None, limits: dict) -> dict:
  config = small.get_config() if model is None else tiny.get_config()
  if model:
    config.model.update(model)
    config.cache.kv_dtype = config.model.dtype
  config.scheduler.update(limits)
  config.cache.num_pages, config.cache.kv_memory_gib = 0, 0.0
  plan = sizing.real_memory_plan(llama, config, config.model)
  shape = model_shape.ModelShape.from_config(config.model)
  estimate = max(memory_plan.step_activation_bytes(
      shape, num_tokens=tokens, num_seqs=seqs, dtype=config.model.dtype,
      traits=backends.traits(config.model))
      for tokens, seqs, _ in sizing.largest_steps(config))
  return dict(model=config.model.name, dtype=config.model.dtype,
              steps=sizing.largest_steps(config), measured_bytes=plan.activation_bytes,
              estimated_bytes=estimate, ratio=estimate / plan.activation_bytes)


def simulated_case(module) -> dict:
  config = module.get_config()
  hardware = hardware_lib.get_hardware(config.hardware)
  plan = sizing.sim_memory_plan(config, hardware)
  without = capacity.plan(model_shape.ModelShape.from_config(config.model), seq_len=16,
                          memory_bytes=hardware.memory_bytes, weight_dtype=config.model.dtype,
                          kv_dtype=config.cache.kv_dtype,
                          tensor_parallel=config.mesh.tensor_parallel)
  return dict(model=config.model.name, dtype=config.model.dtype, hardware=hardware.name,
              tensor_parallel=config.mesh.tensor_parallel, plan=plan.to_dict(),
              pages_without_plan=without.pool_pages + 1)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  measured = {name: measured_case(*case) for name, case in MEASURED_CASES.items()}
  simulated = [simulated_case(module) for module in SIMULATED]
  mib = 2**20
  print("Activation reserve of the largest steps: measured (real) vs estimated (sim)")
  print(f"{'case':<52} {'measured MiB':>12} {'estimated MiB':>13} {'ratio':>6}")
  for name, row in measured.items():
    print(f"{name:<52} {row['measured_bytes'] / mib:>12.1f} "
          f"{row['estimated_bytes'] / mib:>13.1f} {row['ratio']:>6.2f}")
  print("\nSimulated memory plans (0.9 of the device; per device of the group)")
  print(f"{'model':<12} {'hardware':<15} {'TP':>2} {'weights GiB':>11} {'act GiB':>8} "
        f"{'KV GiB':>7} {'pages':>8} {'pages, all memory':>17}")
  for row in simulated:
    plan = row["plan"]
    print(f"{row['model']:<12} {row['hardware']:<15} {row['tensor_parallel']:>2} "
          f"{plan['weight_bytes'] / 2**30:>11.2f} {plan['activation_bytes'] / 2**30:>8.2f} "
          f"{plan['kv_pool_bytes'] / 2**30:>7.2f} {plan['num_pages']:>8,} "
          f"{row['pages_without_plan']:>17,}")
  record = dict(measured=measured, simulated=simulated, utilization=0.9,
                **premises.environment())
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=2)
  print(f"\nwrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
