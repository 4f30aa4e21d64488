"""What the simulator and the capacity model need to know about one device.

The table of real devices, each entry citing its datasheet, is a config
(`configs/hardware.py`); the library only defines the record, so it never imports configs.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
  """One device. Units: bytes, bytes/s, FLOP/s."""

  name: str
  memory_bytes: int
  nominal_memory_gb: float
  hbm_bandwidth: float
  peak_flops: float
  source: str
  host_link_bandwidth: float = 25e9
  compute_efficiency: float = 0.6
  bandwidth_efficiency: float = 0.8
  step_overhead_s: float = 1e-3
  # Tensor-parallel all-reduces: bytes/s each way per device, and seconds per all-reduce.
  interconnect_bandwidth: float = 300e9
  interconnect_latency_s: float = 2e-5
  # Which interconnect's all-reduce profile prices its tensor-parallel groups
  # (`OperatorRates.allreduce`): "nvswitch" (every GPU of a node on NVLink switches) or
  # "nvlink_pairs" (GPUs bridged in pairs); any other: the two figures above.
  network: str = "nvswitch"
  # A calibration file (under configs/calibrations/) whose fitted step rates replace the
  # template ones; None: the template.
  calibration: str | None = None
  efficiency_source: str = (
      "templates: ~60% of dense tensor-core peak for large GEMMs and ~80% of peak HBM "
      "bandwidth for streaming kernels are typical measured fractions (e.g. the "
      "FlashAttention-2 paper reports 50-73% of A100 peak; STREAM-like copies reach 80-90% "
      "of HBM peak); ~1 ms per step of launch and framework overhead and ~25 GB/s of "
      "usable host<->device bandwidth (PCIe Gen4 x16, 32 GB/s peak) are likewise "
      "templates to re-measure on the target machine; all-reduces at NVLink's 300 GB/s "
      "each way (A100: 600 GB/s total) and ~20 us of NCCL small-message latency."
  )
