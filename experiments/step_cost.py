r"""What one step costs in the simulator, part by part.

  python -m experiments.step_cost --config=configs/yi_34b.py --hardware=a100_80gb_pcie \
      --tensor_parallel=2 --num_tokens=512 --num_decode=100 --context=700 --json

prices one step of `--num_tokens` tokens: `--num_decode` decode rows (one token each,
at `--context` tokens of context) and the rest one prompt chunk (after
`--prompt_prefix` tokens of its prompt already in the cache), on one device of the
tensor-parallel group, with the rates the simulator would use (`--calibration`, else
the hardware entry's). It prints the named parts (`StepModel.named_parts`: launch,
per-sequence work, ONE layer's non-attention operators, all-reduces and attention,
the once-a-step operators, swaps, the total), each layer operator's seconds when the
rates are per-operator, and the premises: the same parts a simulated run writes per
step into `steps.jsonl`.
"""

import json
from typing import Any

from absl import flags

from configs import base as configs_check
from configs import hardware as hardware_lib
from experiments import cli
from kvpage import build

_CONFIG = cli.define_config("configs/yi_34b.py", "Model config file.")
_HARDWARE = flags.DEFINE_string(
    "hardware", None, f"Device; one of {sorted(hardware_lib.HARDWARE)}. Default: the config's.")
_TENSOR_PARALLEL = cli.define_tensor_parallel()
_CALIBRATION = flags.DEFINE_string("calibration", None, "A calibration file whose rates price "
                                   "the step; default: the hardware entry's.")
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 512, "Tokens the step computes.")
_NUM_DECODE = flags.DEFINE_integer("num_decode", 0, "Decode rows among them (one token each).")
_CONTEXT = flags.DEFINE_integer("context", 1024, "Context tokens of each decode row.")
_PROMPT_PREFIX = flags.DEFINE_integer(
    "prompt_prefix", 0, "Tokens of the prompt chunk's prompt already in the cache.")
_JSON = flags.DEFINE_bool("json", False, "Print JSON, not a table.")


def sequences(num_tokens: int, num_decode: int, context: int,
              prompt_prefix: int) -> list[tuple[int, int]]:
  """`(new tokens, context)` per sequence of the step the flags describe."""
  for name, value, low in (("num_tokens", num_tokens, 1), ("num_decode", num_decode, 0),
                           ("context", context, 1), ("prompt_prefix", prompt_prefix, 0)):
    if value < low:
      raise ValueError(f"--{name} must be >= {low}, got {value}")
  if num_decode > num_tokens:
    raise ValueError(f"--num_decode={num_decode} is more than --num_tokens={num_tokens}")
  chunk = num_tokens - num_decode
  return [(1, context)] * num_decode + ([(chunk, prompt_prefix + chunk)] if chunk else [])


def report(config: Any, hardware_name: str, calibration_file: str, num_tokens: int,
           num_decode: int, context: int, prompt_prefix: int) -> dict[str, Any]:
  """The step's parts and premises (see the module docstring)."""
  configs_check.check(config)
  hardware = hardware_lib.get_hardware(hardware_name)
  rates, source = build.step_rates(hardware, calibration_file, hardware_lib.CALIBRATIONS)
  model = build.step_model(config, rates, hardware)
  step = sequences(num_tokens, num_decode, context, prompt_prefix)
  sampled = num_decode + (1 if num_tokens > num_decode else 0)
  cost = model.step_cost(step, num_sampled=sampled)
  record: dict[str, Any] = dict(model.named_parts(cost))
  if rates.operators is not None:
    record["layer_operators_s"] = model.layer_parts(num_tokens)
    record["step_operators"] = model.step_operator_parts(num_tokens, sampled)
  record["parts_s"] = cost.parts
  record["premises"] = dict(
      model=config.model.name, dtype=config.model.dtype, kv_dtype=config.cache.kv_dtype,
      num_layers=config.model.num_layers, hardware=hardware.name,
      tensor_parallel=config.mesh.tensor_parallel, calibration=source,
      step=dict(num_tokens=num_tokens, num_decode=num_decode, context=context,
                prompt_chunk=num_tokens - num_decode, prompt_prefix=prompt_prefix,
                num_sampled=sampled))
  return record


def table(record: dict[str, Any]) -> str:
  p = record["premises"]
  step = p["step"]
  lines = [f"{p['model']} ({p['dtype']}) on {p['hardware']}, tensor parallel "
           f"{p['tensor_parallel']}; {p['calibration']}",
           f"step: {step['num_tokens']} tokens = {step['num_decode']} decodes at "
           f"{step['context']} tokens of context + a prompt chunk of {step['prompt_chunk']} "
           f"after {step['prompt_prefix']}"]
  layers = p["num_layers"]
  for key, label in (("launch_s", "launch"), ("sequences_s", "per-sequence work"),
                     ("non_attention_layer_s", f"non-attention, one layer (x{layers})"),
                     ("all_reduce_layer_s", f"all-reduces, one layer (x{layers})"),
                     ("attention_layer_s", f"attention, one layer (x{layers})"),
                     ("step_operators_s", "embedding, final norm, LM head"),
                     ("swap_s", "swaps"), ("total_s", "total")):
    lines.append(f"  {label:<38} {1e3 * record[key]:>10.3f} ms")
  for name, seconds in record.get("layer_operators_s", {}).items():
    lines.append(f"    {name:<36} {1e3 * seconds:>10.4f} ms")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = cli.load_config_with_mesh(_CONFIG, _TENSOR_PARALLEL)
  record = report(config, _HARDWARE.value or config.hardware, _CALIBRATION.value or "",
                  _NUM_TOKENS.value, _NUM_DECODE.value, _CONTEXT.value, _PROMPT_PREFIX.value)
  print(json.dumps(record) if _JSON.value else table(record))


if __name__ == "__main__":
  cli.run(main)
