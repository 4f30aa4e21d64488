"""The premises every kvpage figure carries: software versions and the machine.

A capacity or throughput number means nothing without the model, precision, lengths,
batching policy and hardware it was measured under. Benchmarks and
experiments merge `environment()` with their own premises into every JSON they write.
Pure Python: reads package metadata, never imports jax.
"""

import importlib.metadata
import os
import platform
import sys
from typing import Any

PACKAGES = ("kvpage", "jax", "jaxlib", "flax", "numpy", "ml-collections", "absl-py",
            "torch", "transformers")


def package_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
  """Installed version of each package, None where it is not installed."""
  versions = {}
  for name in packages:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return versions


def environment() -> dict[str, Any]:
  """Python, OS, CPU count, and package versions of this run."""
  return dict(python=sys.version.split()[0], platform=platform.platform(),
              processor=platform.processor() or platform.machine(),
              cpu_count=os.cpu_count(), packages=package_versions())
