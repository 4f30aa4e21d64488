"""kvpage's native CPU kernels: C++ called from XLA through its FFI, built on first use.

XLA:CPU leaves two things on the table that serving needs, and the kernels here take
them back:

  * `paged_attention.cc`: attention that reads a page table's pages where they lie
    (XLA:CPU can only gather them into a fresh copy first), for decode rows and prompt
    chunks; wrapped by `kvpage.device.attention.cpu`.
  * `linear.cc`: the matrix products of a step over a few dozen rows on all cores
    (XLA:CPU runs them on one); wrapped by `kvpage.device.cpu.linear`.
  * `linear_amx.cc`: products of many rows (prompt chunks) on Intel AMX in three bf16
    passes, for `Precision.HIGH`; also wrapped by `kvpage.device.cpu.linear`.

Both run their tasks on kvpage's own worker threads (`common.h`), which stay awake
between the kernels of one step, so a decode step's many small kernels do not each
pay a thread wake-up.

The library is compiled on first use with the machine's C++ compiler (`$CXX`, else
`g++`) against the installed jaxlib's FFI headers, for this CPU (`-march=native`),
and cached in `$KVPAGE_CACHE_DIR` (default `~/.cache/kvpage`) under a key of the
sources, the flags, the jaxlib version and the CPU's model and flags, so a changed CPU
or jaxlib gets a fresh build. Where no compiler is found or the build fails, `status()`
says why, with one warning in the log, and every caller keeps to plain XLA.
"""

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
from typing import Any

import jax
import jaxlib

log = logging.getLogger(__name__)

# The library is built from every source here, with the header they share.
SOURCES = tuple(sorted(pathlib.Path(__file__).parent.glob("*.cc")))
HEADERS = tuple(sorted(pathlib.Path(__file__).parent.glob("*.h")))
# The FFI targets' registered names, and the library symbols that implement them.
TARGETS = {"kvpage_paged_decode": "KvpagePagedDecode",
           "kvpage_paged_prefill": "KvpagePagedPrefill",
           "kvpage_paged_prefill_bf16x3": "KvpagePagedPrefillBf16x3",
           "kvpage_linear": "KvpageLinear",
           "kvpage_swiglu": "KvpageSwiglu",
           "kvpage_linear_bf16x3": "KvpageLinearBf16x3",
           "kvpage_swiglu_bf16x3": "KvpageSwigluBf16x3"}
# Reassociation lets the dot products and sums vectorize. Not -ffast-math: a library
# linked with it sets the CPU to flush subnormals to zero in every thread that loads it.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-fPIC", "-shared", "-std=c++17", "-w")


def _cpu_identity() -> str:
  """The CPU's model and feature flags: a build for one CPU may not run on another."""
  try:
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return platform.processor() or platform.machine()
  wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
  return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _cache_dir() -> pathlib.Path:
  default = pathlib.Path.home() / ".cache" / "kvpage"
  return pathlib.Path(os.environ.get("KVPAGE_CACHE_DIR") or default)


def _build() -> pathlib.Path:
  """The compiled library's path: cached, else compiled now. Raises `RuntimeError`."""
  compiler = os.environ.get("CXX", "g++")
  if shutil.which(compiler) is None:
    raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (set $CXX)")
  include = jax.ffi.include_dir()
  key = hashlib.sha256("\0".join([
      *(path.read_text() for path in SOURCES + HEADERS), compiler, *FLAGS, include,
      jaxlib.__version__, _cpu_identity(), platform.machine()]).encode()).hexdigest()[:16]
  library = _cache_dir() / f"kernels-{key}.so"
  if library.exists():
    return library
  library.parent.mkdir(parents=True, exist_ok=True)
  # Built beside its final name, then renamed: concurrent builders (test workers) never
  # load a half-written file.
  with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
    partial = pathlib.Path(scratch) / library.name
    command = [compiler, *FLAGS, f"-I{include}", *map(str, SOURCES), "-o", str(partial),
               "-pthread"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
      raise RuntimeError(f"`{shlex.join(command)}` failed:\n{result.stderr[-2000:]}")
    os.replace(partial, library)
  return library


@functools.cache
def _library() -> ctypes.CDLL:
  return ctypes.cdll.LoadLibrary(str(_build()))


@functools.cache
def status() -> str:
  """"ready" once the kernels are built and registered with XLA, else why they are not."""
  try:
    library = _library()
    for target, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                  platform="cpu")
  except (RuntimeError, OSError, AttributeError) as error:
    log.warning("kvpage's CPU kernels are unavailable (%s); attention_impl='cpu' and "
                "linear_impl='cpu' use the XLA paths", error)
    return f"unavailable: {error}"
  return "ready"


@functools.cache
def amx() -> bool:
  """Whether `linear_amx.cc` runs here: kernels ready, built for a CPU with AMX (bf16
  tiles), and the OS grants this process the tile registers."""
  return status() == "ready" and bool(_library().KvpageAmxAvailable())


def _precision(precision: Any) -> jax.lax.Precision | None:
  """A `dot_general` precision argument (None, a `Precision` or its name, an algorithm
  preset, or a pair of them) as one `Precision`, the lower of a pair; None for anything
  else (another algorithm). None defers to `jax_default_matmul_precision`."""
  if isinstance(precision, (tuple, list)):
    pair = [_precision(p) for p in precision]
    return None if None in pair else min(pair, key=lambda p: p.value)
  if precision is None:
    precision = jax.config.jax_default_matmul_precision or "default"
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    precision = precision.name
  if precision == "BF16_BF16_F32_X3":  # the algorithm `Precision.HIGH` names
    return jax.lax.Precision.HIGH
  try:
    return jax.lax.Precision(precision)
  except (ValueError, TypeError):
    return None


def bf16x3(precision: Any) -> bool:
  """Whether products at `precision` (a `dot_general` precision argument) run on AMX in
  three bf16 passes here: JAX's `Precision.HIGH` ("bf16_3x"), where `amx()`."""
  return _precision(precision) == jax.lax.Precision.HIGH and amx()
