r"""Fit per-operator rates to per-operator GPU profiles; write the operator calibration.

  python -m experiments.fit_operators \
      --out=configs/calibrations/a100_80gb_operators.json

reads the A100 profiles the repository ships (`configs/calibrations/vidur/`, from
Vidur; its README says what was measured), fits one set of GEMM and elementwise rates
on every model, token count and tensor-parallel degree, and all-reduce rates per
interconnect and group size (`kvpage.sim.operators` says how), and judges the fit by
leaving one model out: fit on the others, predict its per-layer non-attention time.
`--profiles` and `--all_reduce` take other files of the same columns (a fuller Vidur
export, or another device's); `--hardware` names the device they were measured on.

The step calibration then prices non-attention work with these rates
(`experiments.calibrate --operators=FILE`) and fits only what they do not cover.
"""

import dataclasses
import json
import pathlib

import numpy as np
from absl import flags

from configs import hardware as hardware_lib
from experiments import cli
from kvpage.sim import operators

VIDUR = hardware_lib.CALIBRATIONS / "vidur"
SOURCE = ("Vidur (Agrawal et al., MLSys 2024), github.com/microsoft/vidur "
          "data/profiling/{compute/a100/*/mlp.csv, network/*/all_reduce.csv}, medians, MIT "
          "licence; copied in configs/calibrations/vidur/")

_PROFILES = flags.DEFINE_string("profiles", str(VIDUR / "a100_mlp.csv"),
                                "Per-operator profile CSV (see configs/calibrations/vidur/).")
_ALL_REDUCE = flags.DEFINE_string("all_reduce", str(VIDUR / "a100_all_reduce.csv"),
                                  "All-reduce profile CSV (network, num_devices, size, "
                                  "all_reduce_ms).")
_HARDWARE = flags.DEFINE_string("hardware", "a100_80gb",
                                f"The device profiled; one of {sorted(hardware_lib.HARDWARE)}.")
_OUT = flags.DEFINE_string("out", None, "Write the operator calibration here.")
_JSON = flags.DEFINE_bool("json", False, "Print the record as JSON, not tables.")


def allreduce_errors(rates: operators.OperatorRates,
                     measured: dict[str, dict[int, list[tuple[float, float]]]]) -> list[dict]:
  """|predicted / measured - 1| per network and group size, over the fitted sizes."""
  rows = []
  for network, sizes in sorted(measured.items()):
    for devices, points in sorted(sizes.items()):
      fitted = dataclasses.replace(rates, network=network)
      errors = np.abs([fitted.allreduce_seconds(nbytes, devices) / seconds - 1.0
                       for nbytes, seconds in points if nbytes <= operators.ALLREDUCE_MAX_BYTES])
      rate = rates.allreduce[network][devices]
      rows.append(dict(network=network, devices=devices, points=len(errors),
                       latency_us=1e6 * rate.latency_s, bandwidth_gb_s=rate.bandwidth / 1e9,
                       median=float(np.median(errors)), p90=float(np.quantile(errors, 0.9))))
  return rows


def main(argv: list[str]) -> None:
  del argv  # Unused.
  hardware = hardware_lib.get_hardware(_HARDWARE.value)
  rows = operators.read_profiles(_PROFILES.value)
  measured = operators.read_allreduce(_ALL_REDUCE.value)
  datasheet = operators.Datasheet.of(hardware)
  rates = operators.fit(rows, measured, measured_on=datasheet, network=hardware.network,
                        source=f"fitted by experiments.fit_operators on {SOURCE}")
  in_sample = np.abs(operators.layer_errors(rates, rows))
  held_out = operators.leave_one_out(rows, measured_on=datasheet, network=hardware.network)
  network = allreduce_errors(rates, measured)
  record = dict(
      operators=rates.to_dict(),
      premises=dict(hardware=hardware.name, dtype="fp16", profiles=_PROFILES.value,
                    all_reduce=_ALL_REDUCE.value, num_rows=len(rows),
                    models=sorted({row.model for row in rows}),
                    layer_error=dict(median=float(np.median(in_sample)),
                                     p90=float(np.quantile(in_sample, 0.9)))),
      leave_one_model_out=held_out, all_reduce_fit=network)
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(json.dumps(record, indent=1) + "\n")
  if _JSON.value:
    print(json.dumps(record))
    return
  print(f"operator rates of {hardware.name} from {len(rows)} profiled layers:")
  print(f"  GEMMs: {1e6 * rates.gemm_floor_s:.2f} us + max(weights at "
        f"{rates.gemm_bandwidth / 1e9:.0f} GB/s, FLOPs at {100 * rates.gemm_peak_fraction:.1f}% "
        f"of {hardware.peak_flops / 1e12:.0f} TFLOP/s x T / (T + {rates.gemm_half_tokens:.1f}))")
  print(f"  elementwise: {1e6 * rates.elementwise_floor_s:.2f} us + bytes at "
        f"{rates.elementwise_bandwidth / 1e9:.0f} GB/s")
  print(f"  per-layer non-attention time, all models: |error| median "
        f"{100 * np.median(in_sample):.1f}%, p90 {100 * np.quantile(in_sample, 0.9):.1f}%")
  print("leave one model out (fit on the others; per-layer non-attention time, every token "
        "count and tensor-parallel degree):")
  print(f"  {'held-out model':<14} {'layers':>6} {'median':>7} {'p90':>6} {'max':>6}")
  for row in held_out:
    print(f"  {row['model']:<14} {row['rows']:>6} {100 * row['median']:>6.1f}% "
          f"{100 * row['p90']:>5.1f}% {100 * row['max']:>5.1f}%")
  print("all-reduce (latency + ring bytes / bandwidth), |error| over the fitted sizes:")
  for row in network:
    print(f"  {row['network']:<13} {row['devices']} devices: {row['latency_us']:.1f} us, "
          f"{row['bandwidth_gb_s']:.0f} GB/s; median {100 * row['median']:.1f}%, "
          f"p90 {100 * row['p90']:.1f}%")
  if _OUT.value:
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
