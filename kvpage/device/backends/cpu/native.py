"""kvpage's native CPU kernels: C++ called from XLA through its FFI, built at install time.

XLA:CPU leaves two things on the table that serving needs, and the kernels here take
them back:

  * `paged_attention.cc`: attention that reads a page table's pages where they lie
    (XLA:CPU can only gather them into a fresh copy first), for decode rows and prompt
    chunks; wrapped by `kvpage.device.backends.cpu.attention`.
  * `linear.cc`: the matrix products of a step over a few dozen rows on all cores
    (XLA:CPU runs them on one); wrapped by `kvpage.device.backends.cpu.linear`.
  * `linear_amx.cc`: products of many rows (prompt chunks) on Intel AMX in three bf16
    passes, for `Precision.HIGH`; also wrapped by `kvpage.device.backends.cpu.linear`.

Both run their tasks on kvpage's own worker threads (`common.h`), which stay awake
between the kernels of one step, so a decode step's many small kernels do not each
pay a thread wake-up.

The build. `pip install .` and `pip install -e .` compile the sources once (setup.py),
against the FFI headers of the jaxlib that pyproject.toml's build requirements pin,
into one library beside this module, `_kernels<EXT_SUFFIX>` (an editable install leaves
it in the source tree). It holds every kernel in three variants, each compiled with
explicit flags for one instruction set: `avx2` (AVX2, FMA), `avx512` (AVX-512 F, VL, BW,
DQ) and `amx` (the same with AVX512-BF16 and the AMX tile unit, which only it uses),
and `dispatch.cc`, compiled for any x86-64 CPU. Nothing is compiled when kvpage runs:
this module loads the file, asks it which variants this CPU runs (cpuid, and for AMX
the OS's grant of the tile registers) and registers the FFI targets (`TARGETS`) of the
most capable one. `KVPAGE_NATIVE_VARIANT=avx2|avx512|amx` picks another that this CPU
runs, for tests and benchmarks. `describe()` names the variant, the compiler and flags.

The kernels' limits (`limits.py`) are compiled into the library; one whose limits are
not `limits.py`'s (built from other sources) is refused, as is one compiled against a
newer jaxlib's FFI headers than the jaxlib running (XLA would refuse its handlers and,
with them, the whole CPU backend). Where the library was not built (installed with
`KVPAGE_NO_NATIVE=1`, or off Linux on x86-64), the CPU lacks AVX2, or the library is
refused, `status()` says why, with one warning in the log, and every caller keeps to
plain XLA.
"""

import ctypes
import dataclasses
import functools
import importlib.machinery
import logging
import os
import pathlib
import re
import sysconfig
from typing import Any

import jax
import jaxlib

from kvpage.device.backends.cpu import limits

log = logging.getLogger(__name__)

# The FFI targets' registered names, and the handler symbols that implement them.
TARGETS = limits.TARGETS
# The library's variants, the least demanding first.
VARIANTS = limits.VARIANTS
# Picks the variant instead of the most capable one this CPU runs (tests, benchmarks).
VARIANT_ENV = "KVPAGE_NATIVE_VARIANT"
_DIR = pathlib.Path(__file__).resolve().parent
_STEM = "_kernels"


def library_path() -> pathlib.Path | None:
  """The installed library (`_kernels<suffix>` beside this module), or None."""
  for suffix in importlib.machinery.EXTENSION_SUFFIXES:
    path = _DIR / f"{_STEM}{suffix}"
    if path.is_file():
      return path
  return None


class _UnavailableError(RuntimeError):
  """Why the kernels cannot run here."""


@dataclasses.dataclass(frozen=True)
class _Library:
  library: ctypes.CDLL
  path: pathlib.Path
  variant: str

  def build(self, key: str) -> str | None:
    value = self.library.KvpageBuild(key.encode())
    return None if value is None else value.decode()


def _declare(library: ctypes.CDLL) -> None:
  """dispatch.cc's functions' signatures."""
  library.KvpageRuns.argtypes = [ctypes.c_char_p]
  library.KvpageRuns.restype = ctypes.c_int
  library.KvpageAmxAvailable.argtypes = []
  library.KvpageAmxAvailable.restype = ctypes.c_int
  library.KvpageHandler.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
  library.KvpageHandler.restype = ctypes.c_void_p
  library.KvpageLimit.argtypes = [ctypes.c_char_p, ctypes.c_int64]
  library.KvpageLimit.restype = ctypes.c_int64
  library.KvpageBuild.argtypes = [ctypes.c_char_p]
  library.KvpageBuild.restype = ctypes.c_char_p


def library_limits(library: ctypes.CDLL) -> dict[str, int | tuple[int, ...]]:
  """The limits `library` was compiled with, for each of `limits.py`'s numbers and
  tuples (missing ones as None)."""
  values: dict[str, Any] = {}
  for name, value in vars(limits).items():
    if not name.isupper() or isinstance(value, bool):
      continue
    if isinstance(value, int):
      values[name] = library.KvpageLimit(name.encode(), -1)
    elif isinstance(value, tuple) and all(isinstance(v, int) for v in value):
      size = library.KvpageLimit(name.encode(), -1)
      values[name] = tuple(library.KvpageLimit(name.encode(), i) for i in range(max(size, 0)))
  return values


def _version(text: str) -> tuple[int, ...]:
  match = re.match(r"\d+(\.\d+)*", text)
  return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def _choose(library: ctypes.CDLL) -> str:
  """The variant to register: `KVPAGE_NATIVE_VARIANT`'s, else the last of `VARIANTS`
  this CPU runs."""
  chosen = os.environ.get(VARIANT_ENV)
  if chosen:
    if chosen not in VARIANTS:
      raise _UnavailableError(f"{VARIANT_ENV}={chosen!r} is not one of {', '.join(VARIANTS)}")
    if library.KvpageRuns(chosen.encode()) != 1:
      raise _UnavailableError(f"{VARIANT_ENV}={chosen}, but this CPU (or OS) does not run the "
                         f"{chosen} variant")
    return chosen
  runs = [variant for variant in VARIANTS if library.KvpageRuns(variant.encode()) == 1]
  if not runs:
    raise _UnavailableError("this CPU lacks AVX2 and FMA, the least the kernels are compiled for")
  return runs[-1]


def _load() -> _Library:
  """The library, checked, and the variant it runs here. Raises `_UnavailableError`."""
  path = library_path()
  if path is None:
    name = _STEM + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    raise _UnavailableError(
        f"the native extension was not built: no {name} in kvpage/device/backends/cpu "
        "(an install with KVPAGE_NO_NATIVE=1, or off Linux on x86-64, skips it; "
        "`pip install -e .` builds it)")
  try:
    library = ctypes.CDLL(str(path))
    _declare(library)
  except (OSError, AttributeError) as error:
    raise _UnavailableError(f"{path.name} does not load: {error}") from error
  for name, value in library_limits(library).items():
    if value != getattr(limits, name):
      raise _UnavailableError(f"{path.name} was built from other sources: its {name} is {value}, "
                         f"limits.py's {getattr(limits, name)} (rebuild: pip install -e .)")
  built = library.KvpageBuild(b"jaxlib").decode()
  if _version(built) > _version(jaxlib.__version__):
    api = library.KvpageBuild(b"ffi_api").decode()
    raise _UnavailableError(
        f"{path.name} was compiled against jaxlib {built}'s FFI headers (XLA FFI API "
        f"{api}), newer than the running jaxlib {jaxlib.__version__}, which refuses its "
        "handlers (rebuild against this jaxlib, or upgrade it)")
  return _Library(library, path, _choose(library))


@functools.cache
def _state() -> tuple[_Library | None, str]:
  """The library registered with XLA and "ready", or None and why not."""
  try:
    loaded = _load()
    for target, symbol in TARGETS.items():
      handler = loaded.library.KvpageHandler(symbol.encode(), loaded.variant.encode())
      if not handler:
        raise _UnavailableError(f"{loaded.path.name} has no {symbol} for {loaded.variant}")
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
  except (RuntimeError, OSError, AttributeError) as error:
    log.warning("kvpage's CPU kernels are unavailable (%s); attention_impl='cpu' and "
                "linear_impl='cpu' use the XLA paths", error)
    return None, f"unavailable: {error}"
  return loaded, "ready"


def status() -> str:
  """"ready" once the kernels are loaded and registered with XLA, else why they are not
  ("unavailable: ...")."""
  return _state()[1]


def variant() -> str | None:
  """The variant registered ("avx2", "avx512" or "amx"), None where none is."""
  loaded = _state()[0]
  return None if loaded is None else loaded.variant


@functools.cache
def amx() -> bool:
  """Whether `linear_amx.cc` runs here: the kernels ready in their amx variant (a CPU
  with AMX bf16 tiles and AVX512-BF16), and the OS grants this process the tiles."""
  loaded = _state()[0]
  return (loaded is not None and loaded.variant == "amx"
          and bool(loaded.library.KvpageAmxAvailable()))


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


def describe() -> dict[str, Any]:
  """The library's state here, for the run records: `status()`, the variant registered
  and whether AMX runs, the library's file name, and how it was built (compiler, the
  variant's flags, the jaxlib whose FFI headers it was compiled against); None where
  unknown."""
  loaded = _state()[0]
  path = library_path()
  record: dict[str, Any] = dict(status=status(), variant=variant(), amx=amx(),
                                library=None if path is None else path.name,
                                compiler=None, flags=None, jaxlib=None, ffi_api=None)
  if loaded is not None:
    record.update(compiler=loaded.build("compiler"), flags=loaded.build(loaded.variant),
                  jaxlib=loaded.build("jaxlib"), ffi_api=loaded.build("ffi_api"))
  return record
