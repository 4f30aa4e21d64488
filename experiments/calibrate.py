r"""Fit the simulator's step rates to measured step times; write a calibration file.

From a published per-batch profile (CSV, the Sarathi-Serve artifact's columns), with
the non-attention work priced by per-operator rates (`experiments.fit_operators`), fit
on the small steps and judged on the large ones:

  python -m experiments.calibrate --config=configs/yi_34b.py \
      --operators=configs/calibrations/a100_80gb_operators.json \
      --profile=configs/calibrations/sarathi-serve/yi34b_tp2_a100_80gb_pcie_decode.csv \
      --profile=configs/calibrations/sarathi-serve/yi34b_tp2_a100_80gb_pcie_prefill.csv \
      --profile_context=1020 --train_max_decode_batch=32 --train_max_prefill_tokens=4096 \
      --loss=absolute --out=configs/calibrations/a100_80gb_pcie.json

From a kvpage run on this machine (`serve_bench`'s `steps.jsonl`), judged on another:

  python -m experiments.calibrate --config=configs/tiny.py --hardware=cpu \
      --steps=workdir/run_a/steps.jsonl --test_steps=workdir/run_b/steps.jsonl --out=cpu.json

The simulator then prices steps with the file: `serve_bench --executor=sim
--calibration=FILE` (a hardware entry may also name one as its default). The fit, the
premises and every point (measured against predicted, training and held-out) print as
a table and go into the file; `kvpage.sim.calibration` says how the fit works.
"""

import dataclasses
import json
import pathlib
from collections.abc import Sequence

from absl import flags

from configs import base as configs_check
from configs import hardware as hardware_lib
from experiments import cli
from kvpage import build
from kvpage.sim import calibration, operators, step_model
from kvpage.sim.step_model import StepModel, StepRates

_CONFIG = cli.define_config("configs/tiny.py", "Model config file (the model that ran).")
_HARDWARE = flags.DEFINE_string(
    "hardware", None, f"Device; one of {sorted(hardware_lib.HARDWARE)}. Default: the config's.")
_TENSOR_PARALLEL = cli.define_tensor_parallel()
_PROFILE = flags.DEFINE_multi_string(
    "profile", [], "Per-batch profile CSV (batch_num_tokens, batch_num_prefill_tokens, "
    "batch_num_decode_tokens, batch_size, batch_execution_time); repeatable.")
_PROFILE_CONTEXT = flags.DEFINE_integer(
    "profile_context", None, "Context tokens of each decode in a profile's decode rows "
    "(profiles do not record it).")
_TRAIN_DECODE = flags.DEFINE_integer(
    "train_max_decode_batch", None, "Profile decode rows with more sequences are held out.")
_TRAIN_PREFILL = flags.DEFINE_integer(
    "train_max_prefill_tokens", None, "Profile prefill rows with more tokens are held out.")
_STEPS = flags.DEFINE_multi_string("steps", [], "steps.jsonl of a kvpage run to fit on.")
_TEST_STEPS = flags.DEFINE_multi_string(
    "test_steps", [], "steps.jsonl of another run, held out (judged, not fit).")
_WEIGHTING = flags.DEFINE_enum("weighting", "absolute", list(calibration.WEIGHTINGS),
                               "Fit seconds (absolute), each step's relative error, or "
                               "seconds with each kind of step weighing the same (by_kind).")
_LOSS = flags.DEFINE_enum("loss", "squares", list(calibration.LOSSES),
                          "Least squares (a mean fit) or least absolute deviations (a median "
                          "fit, robust to the long tail of a shared CPU's step times).")
_OPERATORS = flags.DEFINE_string(
    "operators", None, "Operator calibration (experiments.fit_operators): it prices the "
    "non-attention work and the all-reduces, carried to --hardware by the datasheets; the "
    "steps then fit only launch, per-sequence and attention costs.")
_KNEE = flags.DEFINE_integer("knee_tokens", None, "Tokens where small steps end; default: the "
                             "hardware's ridge point, rounded down to a power of two.")
_OUT = flags.DEFINE_string("out", None, "Write the calibration file here.")
_JSON = flags.DEFINE_bool("json", False, "Print the calibration record as JSON, not a table.")

def step_samples(paths: Sequence[str],
                 model: StepModel) -> tuple[list[calibration.Sample], int, bool, bool]:
  """Samples from kvpage `steps.jsonl` files, how many rows were skipped (multi-step
  launches, empty steps, steps without a recorded time), whether any step was padded,
  and whether padded decode rows read to the longest decode context (the executor
  recorded `decode_longest`): each step is counted as its executor computed it
  (`padded_counts`), and as launched after the device idled when it began
  `step_model.IDLE_GAP_S` or more after the previous step's row (the run's start, for
  the first): a row's `time` is when its step's samples came back."""
  steps, skipped = [], 0
  for path in paths:
    try:
      lines = pathlib.Path(path).read_text().splitlines()
    except OSError as error:
      raise ValueError(f"{path}: cannot read it ({error.strerror or error})") from None
    last_end = 0.0
    for number, line in enumerate(lines, start=1):
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        raise ValueError(f"{path} line {number}: not JSON") from None
      if "work" not in row:
        raise ValueError(f"{path} line {number}: no `work` record (a run from before "
                         "kvpage recorded step work)")
      seconds, work = row.get("step_s"), row["work"]
      previous_end, last_end = last_end, row["time"]
      if not seconds or work["iterations"] != 1 or not work["num_tokens"]:
        skipped += 1
        continue
      idle = row["time"] - seconds - previous_end >= step_model.IDLE_GAP_S
      steps.append((row, float(seconds), idle))
  # An executor that pads (kvpage's) pads every step, and its XLA decode pass reads
  # each row as far as the longest context even when a batch needs no padding rows; an
  # executor that does not (an unbucketed simulation) records shapes equal to the work.
  padded = any("padded_tokens" in row["work"] and (
      row["work"]["padded_tokens"], row["work"]["padded_sequences"]) != (
          row["work"]["num_tokens"], row["work"]["num_sequences"]) for row, _, _ in steps)
  samples = []
  for row, seconds, idle in steps:
    work = row["work"]
    counts = {key: work[key] for key in ("num_tokens", "num_sequences", "num_sampled",
                                         "prefill_pairs", "decode_context")}
    if padded and "padded_tokens" in work:
      counts = step_model.padded_counts(counts, work["padded_tokens"], work["padded_sequences"],
                                        work.get("decode_longest"))
    samples.append(calibration.Sample(model.work_from_counts(
        **counts, num_swapped_pages=work["swap_pages"], after_idle=idle), seconds,
        f"step {row['step']}"))
  reads_longest = padded and any("decode_longest" in row["work"] for row, _, _ in steps)
  return samples, skipped, padded, reads_longest


def table(rows: list[dict]) -> str:
  lines = [f"{'step':<22} {'split':<9} {'tokens':>7} {'seqs':>5} {'measured ms':>12} "
           f"{'predicted ms':>13} {'error':>7}"]
  lines += [f"{row['label']:<22} {row['split']:<9} {row['num_tokens']:>7} "
            f"{row['num_sequences']:>5} {1e3 * row['measured_s']:>12.2f} "
            f"{1e3 * row['predicted_s']:>13.2f} {100 * row['error']:>+6.1f}%" for row in rows]
  return "\n".join(lines)


def summary(rows: list[dict], split: str) -> str:
  errors = [abs(row["error"]) for row in rows if row["split"] == split]
  if not errors:
    return f"{split}: none"
  median = sorted(errors)[len(errors) // 2]
  return (f"{split}: {len(errors)} steps, |error| median {100 * median:.1f}%, "
          f"max {100 * max(errors):.1f}%")


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = cli.load_config_with_mesh(_CONFIG, _TENSOR_PARALLEL)
  configs_check.check(config)
  hardware = hardware_lib.get_hardware(_HARDWARE.value or config.hardware)
  if not _PROFILE.value and not _STEPS.value:
    raise ValueError("give measured steps: --profile=CSV or --steps=steps.jsonl")
  if _KNEE.value is not None and _KNEE.value < 1:
    raise ValueError(f"--knee_tokens must be >= 1, got {_KNEE.value}")
  start = StepRates.template(hardware)
  if _OPERATORS.value:
    start = dataclasses.replace(start, regimes=None, operators=operators.load(
        _OPERATORS.value).carried_to(hardware))
  model = build.step_model(config, start, hardware)
  train, held = [], []
  for path in _PROFILE.value:
    fit_part, held_part = calibration.split_held_out(
        calibration.profile_samples(path, model, _PROFILE_CONTEXT.value),
        max_decode_batch=_TRAIN_DECODE.value, max_prefill_tokens=_TRAIN_PREFILL.value)
    train += fit_part
    held += held_part
  steps, skipped, padded, reads_longest = step_samples(_STEPS.value, model)
  test, test_skipped, _, _ = step_samples(_TEST_STEPS.value, model)
  train += steps
  held += test
  sources = [*(_PROFILE.value), *(_STEPS.value)]
  result = calibration.fit(train, model, hardware, weighting=_WEIGHTING.value,
                           loss=_LOSS.value, knee_tokens=_KNEE.value, padded_work=padded,
                           decode_reads_longest=reads_longest,
                           source="fitted by experiments.calibrate on " + ", ".join(sources))
  priced = model.with_rates(result.rates)
  rows = calibration.points(train, priced, "train") + calibration.points(held, priced, "held-out")
  premises = dict(model=config.model.name, dtype=config.model.dtype,
                  tensor_parallel=config.mesh.tensor_parallel, hardware=hardware.name,
                  operators=_OPERATORS.value, profiles=_PROFILE.value,
                  profile_context=_PROFILE_CONTEXT.value,
                  train_max_decode_batch=_TRAIN_DECODE.value,
                  train_max_prefill_tokens=_TRAIN_PREFILL.value, steps=_STEPS.value,
                  test_steps=_TEST_STEPS.value, skipped_steps=skipped + test_skipped,
                  num_train=len(train), num_held_out=len(held))
  if _OUT.value:
    calibration.save(_OUT.value, result, premises, rows)
  if _JSON.value:
    print(json.dumps(calibration.record(result, premises, rows)))
    return
  print(f"calibration of {config.model.name} ({config.model.dtype}, tensor parallel "
        f"{config.mesh.tensor_parallel}) on {hardware.name}: {len(train)} steps fit, "
        f"{len(held)} held out" + (f", {skipped + test_skipped} skipped (multi-step or untimed)"
                                   if skipped + test_skipped else ""))
  print("\n".join("  " + line for line in result.describe()))
  print(table(rows))
  print(summary(rows, "train"))
  print(summary(rows, "held-out"))
  if _OUT.value:
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
