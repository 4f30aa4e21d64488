"""The premises every kvpage figure carries: software versions and the machine.

A capacity or throughput number means nothing without the model, precision, lengths,
batching policy and hardware it was measured under, nor without the limits the run
was held to (a cgroup's memory, the CPUs it may use, the XLA flags in force).
Benchmarks and experiments merge `environment()` with their own premises into every
JSON they write. Pure Python: reads package metadata, `/proc` and `/sys`, never
imports jax (the JAX/XLA settings are read from the environment variables).
"""

import importlib.metadata
import os
import pathlib
import platform
import resource
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


def _read_int(path: str) -> int | None:
  """The integer in a `/sys` or `/proc` file; None if absent, unreadable or `max`."""
  try:
    return int(pathlib.Path(path).read_text().split()[0])
  except (OSError, ValueError, IndexError):
    return None


def memory_limit() -> dict[str, Any]:
  """The memory limit in force: the tightest of cgroup v2 `memory.max`, cgroup v1's
  limit and `RLIMIT_AS`, in bytes, and which one it is (None, None if unlimited)."""
  limits = []
  for source, path in (("cgroup memory.max", "/sys/fs/cgroup/memory.max"),
                       ("cgroup v1 limit", "/sys/fs/cgroup/memory/memory.limit_in_bytes")):
    value = _read_int(path)
    if value is not None and value < 2**60:  # v1 writes "no limit" as a huge number
      limits.append((value, source))
  soft, _ = resource.getrlimit(resource.RLIMIT_AS)
  if soft != resource.RLIM_INFINITY:
    limits.append((soft, "RLIMIT_AS"))
  if not limits:
    return dict(bytes=None, source=None)
  value, source = min(limits)
  return dict(bytes=value, source=source)


def available_memory_bytes() -> int | None:
  """Host memory this process could still allocate: the kernel's `MemAvailable`,
  capped by what a cgroup or address-space limit leaves. None if unknown."""
  candidates = []
  try:
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
      if line.startswith("MemAvailable:"):
        candidates.append(int(line.split()[1]) * 1024)
  except (OSError, ValueError, IndexError):
    pass
  limit = memory_limit()
  if limit["source"] == "cgroup memory.max":
    used = _read_int("/sys/fs/cgroup/memory.current") or 0
    candidates.append(max(0, limit["bytes"] - used))
  elif limit["bytes"] is not None:
    candidates.append(limit["bytes"])
  return min(candidates) if candidates else None


def cpu_threads() -> int | None:
  """CPUs this process may run on (its affinity mask), which a container may cap
  below `os.cpu_count()`."""
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count()


def jax_settings() -> dict[str, str]:
  """Every `JAX_*`, `XLA_*` and `TF_CPP_*` environment variable (`XLA_FLAGS` among them):
  read here rather than from jax, which the host world never imports."""
  prefixes = ("JAX_", "XLA_", "TF_CPP_")
  return {key: value for key, value in sorted(os.environ.items()) if key.startswith(prefixes)}


def environment() -> dict[str, Any]:
  """Python, OS, CPUs, the memory limit, JAX/XLA settings and package versions."""
  return dict(python=sys.version.split()[0], platform=platform.platform(),
              processor=platform.processor() or platform.machine(),
              cpu_count=os.cpu_count(), cpu_threads=cpu_threads(),
              memory_limit=memory_limit(), jax_settings=jax_settings(),
              packages=package_versions())
