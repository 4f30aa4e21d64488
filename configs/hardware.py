"""Hardware specs as data: one table, each entry citing its datasheet.

`memory_bytes` is the device memory that `nvidia-smi` reports as total (MiB x 2^20),
the honest figure for capacity planning; `nominal_memory_gb` is the marketing figure
("80GB") that back-of-envelope arithmetic reads as 10^9 bytes. Bandwidth is the
datasheet's peak HBM bandwidth in bytes/s, and `peak_flops` the dense (no sparsity)
fp16/bf16 tensor-core peak in FLOP/s. Efficiency factors (the fraction of peak a
well-tuned kernel reaches) give the simulated executor its template step rates; they
are templates, to be re-decided from measurements, not truths. An entry that names a
`calibration` (a file in `configs/calibrations/`, fitted by `experiments/calibrate.py`
on published or local step times) is priced by that file's rates instead, carried to
the entry by the ratios of the datasheets when the file was measured on another
device (`kvpage.sim.step_model.StepRates.carried_to`): `h100_80gb` and `h200_141gb`
are priced by the A100 PCIe calibration (per-operator A100 rates and Sarathi-Serve's
Yi-34B steps) so carried. `network` names the all-reduce profile of the entry's
interconnect (`kvpage.sim.operators`).
"""

import pathlib

from kvpage.sim.hardware import HardwareSpec

# The calibration files the entries name (`kvpage.build.step_rates(calibrations=...)`).
CALIBRATIONS = pathlib.Path(__file__).parent / "calibrations"

_MIB = 2**20


HARDWARE: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in (
        HardwareSpec(
            name="a100_40gb",
            memory_bytes=40_960 * _MIB,
            nominal_memory_gb=40,
            hbm_bandwidth=1_555e9,
            peak_flops=312e12,
            source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB: 1,555 GB/s HBM2, "
            "312 TFLOPS dense FP16/BF16); nvidia-smi total 40,960 MiB",
        ),
        HardwareSpec(
            name="a100_80gb",
            memory_bytes=81_920 * _MIB,
            nominal_memory_gb=80,
            hbm_bandwidth=2_039e9,
            peak_flops=312e12,
            source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 2,039 GB/s HBM2e, "
            "312 TFLOPS dense FP16/BF16); nvidia-smi total 81,920 MiB",
        ),
        HardwareSpec(
            name="a100_80gb_pcie",
            memory_bytes=81_920 * _MIB,
            nominal_memory_gb=80,
            hbm_bandwidth=1_935e9,
            peak_flops=312e12,
            source="NVIDIA A100 Tensor Core GPU datasheet (PCIe 80GB: 1,935 GB/s HBM2e, "
            "312 TFLOPS dense FP16/BF16, NVLink bridge for 2 GPUs at 600 GB/s); "
            "nvidia-smi total 81,920 MiB",
            calibration="a100_80gb_pcie.json",
            network="nvlink_pairs",
        ),
        HardwareSpec(
            name="h100_80gb",
            memory_bytes=81_559 * _MIB,
            nominal_memory_gb=80,
            hbm_bandwidth=3_350e9,
            peak_flops=989.4e12,
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM5 80GB: 3.35 TB/s HBM3, "
            "1,979 TFLOPS FP16/BF16 with sparsity = 989.4 dense); nvidia-smi total 81,559 MiB",
            calibration="a100_80gb_pcie.json",
            host_link_bandwidth=50e9,  # PCIe Gen5 x16: 64 GB/s peak
            interconnect_bandwidth=450e9,  # NVLink 4: 900 GB/s total
        ),
        HardwareSpec(
            name="h200_141gb",
            memory_bytes=143_771 * _MIB,
            nominal_memory_gb=141,
            hbm_bandwidth=4_800e9,
            peak_flops=989.4e12,
            source="NVIDIA H200 Tensor Core GPU datasheet (SXM 141GB: 4.8 TB/s HBM3e, "
            "1,979 TFLOPS FP16/BF16 with sparsity = 989.4 dense); nvidia-smi total 143,771 MiB",
            calibration="a100_80gb_pcie.json",
            host_link_bandwidth=50e9,  # PCIe Gen5 x16: 64 GB/s peak
            interconnect_bandwidth=450e9,  # NVLink 4: 900 GB/s total
        ),
        HardwareSpec(
            name="cpu",
            memory_bytes=24 * 2**30,
            nominal_memory_gb=24,
            hbm_bandwidth=41e9,
            peak_flops=0.3e12,
            source="the project's 2-core AVX-512 development VM: 24 GiB, "
            "~41 GB/s measured for a 1 GiB numpy copy; peak FLOP/s is an estimate "
            "(2 cores x 2 FMA x 16 fp32 lanes x 2 x ~2.5 GHz)",
            host_link_bandwidth=20e9,  # a host "swap" is a memcpy here
            compute_efficiency=0.3,
            bandwidth_efficiency=0.7,
            step_overhead_s=2e-4,
            interconnect_bandwidth=20e9,  # devices forced on one host: a memcpy
            interconnect_latency_s=5e-5,
            network="host",
        ),
    )
}


def get_hardware(name: str) -> HardwareSpec:
  """Returns the spec called `name`, or raises ValueError naming the valid choices."""
  try:
    return HARDWARE[name]
  except KeyError:
    raise ValueError(
        f"unknown hardware {name!r}; choose one of: {', '.join(sorted(HARDWARE))}"
    ) from None
