"""kvpage: serve Transformer LLMs under rising concurrency by holding the KV-cache line.

The native CPU kernels (`kvpage/device/backends/cpu/*.cc`, C++ behind XLA's FFI) are
compiled here, once, at install time (`pip install .`, `pip install -e .`), into one
shared library beside their loader: `kvpage/device/backends/cpu/_kernels<EXT_SUFFIX>`
(in the source tree for an editable install; git ignores it). Nothing is compiled when
kvpage runs. The library holds every kernel in three variants, each compiled with
explicit flags for one instruction set (`VARIANT_FLAGS`: avx2, avx512, amx), and
`dispatch.cc`, compiled for any x86-64 CPU, which tells the loader (`native.py`) which
variant this CPU runs. The kernels' limits and handler names come from
`kvpage/device/backends/cpu/limits.py`, written into a header generated in the build
directory (`kvpage_build.h`) with the compiler and flags of the build. XLA's FFI
headers come from jaxlib, which pyproject.toml's `[build-system]` pins to the oldest
release `install_requires` allows: a library built against a jaxlib's headers registers
with that jaxlib and newer ones, never with older ones (see `native.py`).

Environment:
  KVPAGE_NO_NATIVE=1  install without the kernels (no compiler needed): kvpage runs
                      everything on XLA, and `native.status()` says the library was not
                      built. Removes a library an earlier editable install left in the
                      source tree (for this Python).
  KVPAGE_WERROR=1     compile with -Werror (CI sets it); warnings are -Wall.
  CXX                 the C++ compiler (default g++; GCC 12 and newer compile every
                      variant, AMX included, on any x86-64 machine).
The kernels are built on Linux on x86-64 only; elsewhere kvpage installs without them.
"""

import ast
import concurrent.futures
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import sysconfig

import setuptools
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, SetupError

HERE = pathlib.Path(__file__).resolve().parent
NATIVE_DIR = "kvpage/device/backends/cpu"
NATIVE = "kvpage.device.backends.cpu._kernels"
DISPATCH = "dispatch.cc"  # compiled once, for any x86-64 CPU
KERNELS = ("paged_attention.cc", "linear.cc", "linear_amx.cc")  # compiled once per variant
HEADERS = ("amx.h", "common.h", "linear.h", "variant.h")
LIMITS = "limits.py"
# Every file: reassociation lets the dot products and sums vectorize. Not -ffast-math: a
# library linked with it sets the CPU to flush subnormals to zero in every thread that
# loads it. The width GCC reassociates sums to is fixed (REASSOCIATION), not left to its
# tuning for one CPU, so the kernels' results do not depend on the build machine. Hidden
# visibility: the library exports dispatch.cc's functions only.
COMMON_FLAGS = ("-std=c++17", "-O3", "-fno-math-errno", "-fno-trapping-math",
                "-fassociative-math", "-fno-signed-zeros", "-fPIC", "-fvisibility=hidden",
                "-fvisibility-inlines-hidden", "-pthread")
# 4 partial sums: what the runtime build's -march=native chose on the reference machine
# (an AVX-512 AMD EPYC), whose results the kernels keep bit for bit. GCC only (Clang has
# no such parameter, and its own reassociation).
REASSOCIATION = ("--param=tree-reassoc-width=4",)
# Each variant's instruction set (limits.py's VARIANTS, in order): what its code uses. The
# kernels' own code is portable vector code (GCC vector extensions: 16-float vectors, two
# registers on AVX2) with FMA; the AMX paths add AVX-512 intrinsics (with BF16) and tiles.
# -Wno-psabi: GCC notes that a 16-float vector passed by value is passed otherwise than
# with AVX-512; no such function is called across variants (`variant.h`), so it is moot.
VARIANT_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-Wno-psabi"),
    "avx512": ("-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"),
    "amx": ("-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq",
            "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
}


def _limits() -> dict:
  """limits.py's constants, read as literals (the file is not imported: no kvpage, no
  jax at build time)."""
  tree = ast.parse((HERE / NATIVE_DIR / LIMITS).read_text())
  values = {}
  for node in tree.body:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
        node.targets[0], ast.Name):
      values[node.targets[0].id] = ast.literal_eval(node.value)
    elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
      raise SetupError(f"{LIMITS} must hold plain literal assignments only (line {node.lineno})")
  return values


def _cc_name(name: str) -> str:
  """A limit's C++ name: MAX_GROUP -> kMaxGroup."""
  return "k" + "".join(word.capitalize() for word in name.lower().split("_"))


def _cc_string(text: str) -> str:
  return json.dumps(text)  # ASCII: a valid C string literal


def _header(limits: dict, compiler: str, jaxlib: str, flags: dict) -> str:
  """kvpage_build.h: limits.py as C++ constants (`kvpage::limits`), the handlers of every
  variant (KVPAGE_HANDLERS), and how the library is built."""
  constants, numbers, tuples = [], [], []
  for name, value in limits.items():
    if isinstance(value, bool) or name in ("TARGETS", "VARIANTS"):
      continue
    if isinstance(value, int):
      constants.append(f"inline constexpr int64_t {_cc_name(name)} = {value};")
      numbers.append(f"  NUMBER({name}, {_cc_name(name)})")
    elif isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
      items = ", ".join(map(str, value))
      text = ", ".join(map(str, value[:-1])) + (" or " if len(value) > 1 else "") + str(value[-1])
      constants.append(f"inline constexpr int64_t {_cc_name(name)}[] = {{{items}}};")
      constants.append(f"inline constexpr char {_cc_name(name)}Text[] = {_cc_string(text)};")
      tuples.append(f"  TUPLE({name}, {_cc_name(name)})")
    else:
      raise SetupError(f"{LIMITS}: {name} is neither an int nor a tuple of ints")
  handlers = [f"  X({symbol}, {variant})" for symbol in limits["TARGETS"].values()
              for variant in limits["VARIANTS"]]
  build_flags = [f"  X({variant}, {_cc_string(' '.join(flags[variant]))})"
                 for variant in limits["VARIANTS"]]
  lines = [
      "// Generated by setup.py from kvpage/device/backends/cpu/limits.py: do not edit.",
      "#ifndef KVPAGE_BUILD_H_", "#define KVPAGE_BUILD_H_", "", "#include <cstdint>", "",
      "namespace kvpage::limits {", *constants, "}  // namespace kvpage::limits", "",
      "// NUMBER(name, C++ name) for each number, TUPLE(name, C++ name) for each tuple.",
      "#define KVPAGE_LIMITS(NUMBER, TUPLE) \\", *(f"{line} \\" for line in numbers + tuples),
      "", "// X(symbol, variant) for every handler of every variant.",
      "#define KVPAGE_HANDLERS(X) \\", *(f"{line} \\" for line in handlers), "",
      "// X(variant, its compiler flags).",
      "#define KVPAGE_BUILD_FLAGS(X) \\", *(f"{line} \\" for line in build_flags), "",
      f"#define KVPAGE_BUILD_COMPILER {_cc_string(compiler)}",
      f"#define KVPAGE_BUILD_JAXLIB {_cc_string(jaxlib)}", "", "#endif  // KVPAGE_BUILD_H_", ""]
  return "\n".join(lines)


def _jaxlib_headers() -> tuple[pathlib.Path, str]:
  """The directory of the build environment's jaxlib FFI headers (what
  `jax.ffi.include_dir()` names, found without importing jaxlib) and jaxlib's version."""
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    raise SetupError("jaxlib is not installed where kvpage is built: its FFI headers are "
                     "needed (pyproject.toml's build requirements bring it; with "
                     "--no-build-isolation install it first, or set KVPAGE_NO_NATIVE=1)")
  include = pathlib.Path(next(iter(spec.submodule_search_locations))) / "include"
  if not (include / "xla" / "ffi" / "api" / "ffi.h").is_file():
    raise SetupError(f"no XLA FFI headers in {include}")
  return include, importlib.metadata.version("jaxlib")


class BuildNative(build_ext):
  """Compiles the kernels' library with the flags above: dispatch.cc for any x86-64 CPU,
  each kernel source once per variant (in parallel), linked least demanding first
  (`variant.h`: what the variants share is then the AVX2 variant's code)."""

  def build_extension(self, ext: setuptools.Extension) -> None:
    if ext.name != NATIVE:
      super().build_extension(ext)
      return
    limits = _limits()
    if tuple(limits["VARIANTS"]) != tuple(VARIANT_FLAGS):
      raise SetupError(f"limits.py's VARIANTS {limits['VARIANTS']} are not setup.py's "
                       f"{tuple(VARIANT_FLAGS)}")
    include, jaxlib = _jaxlib_headers()
    cxx = shlex.split(os.environ.get("CXX") or "g++")
    warnings = ("-Wall", "-Werror") if os.environ.get("KVPAGE_WERROR") == "1" else ("-Wall",)
    try:
      version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    except OSError as error:
      raise SetupError(f"no C++ compiler ({error}): set CXX, or KVPAGE_NO_NATIVE=1 to "
                       "install without the native kernels") from error
    common = (*COMMON_FLAGS, *(() if "clang" in version else REASSOCIATION), *warnings)
    flags = {variant: (*common, *extra) for variant, extra in VARIANT_FLAGS.items()}
    work = pathlib.Path(self.build_temp).resolve() / "kvpage_native"
    work.mkdir(parents=True, exist_ok=True)
    (work / "kvpage_build.h").write_text(
        _header(limits, pathlib.Path(cxx[0]).name, jaxlib, flags))
    source_dir = HERE / NATIVE_DIR
    includes = ("-I", str(work), "-I", str(source_dir), "-isystem", str(include))
    jobs = [(source_dir / DISPATCH, work / "dispatch.o", common, ())]
    for level, variant in enumerate(VARIANT_FLAGS):
      defines = (f"-DKVPAGE_VARIANT={variant}", f"-DKVPAGE_VARIANT_LEVEL={level}")
      jobs += [(source_dir / source, work / f"{variant}-{pathlib.Path(source).stem}.o",
                flags[variant], defines) for source in KERNELS]
    commands = [[*cxx, *job_flags, *defines, *includes, "-c", str(source), "-o", str(obj)]
                for source, obj, job_flags, defines in jobs]
    workers = self.parallel if isinstance(self.parallel, int) and self.parallel > 0 else (
        os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      for command, result in zip(commands, pool.map(self._run, commands)):
        if result.returncode != 0:
          raise CompileError(f"`{shlex.join(command)}` failed:\n{result.stderr}")
        if result.stderr:
          self.announce(result.stderr, level=3)
    library = pathlib.Path(self.get_ext_fullpath(ext.name))
    library.parent.mkdir(parents=True, exist_ok=True)
    # Exports dispatch.cc's functions only (the C++ library's inline functions too would
    # be, hidden visibility notwithstanding); a handler missing from a variant, or any
    # other undefined symbol, fails here rather than when the library loads.
    exports = work / "exports.map"
    exports.write_text("{ global: Kvpage*; local: *; };\n")
    link = [*cxx, "-shared", "-pthread", "-Wl,--no-undefined",
            f"-Wl,--version-script={exports}", *(str(obj) for _, obj, _, _ in jobs), "-o",
            str(library)]
    result = self._run(link)
    if result.returncode != 0:
      raise CompileError(f"`{shlex.join(link)}` failed:\n{result.stderr}")

  def _run(self, command: list[str]) -> subprocess.CompletedProcess:
    self.announce(shlex.join(command), level=2)
    return subprocess.run(command, capture_output=True, text=True, cwd=HERE)


def _native_extensions() -> list[setuptools.Extension]:
  """The kernels' library, where it is built (Linux, x86-64, no KVPAGE_NO_NATIVE=1)."""
  built_here = sys.platform.startswith("linux") and platform.machine().lower() in (
      "x86_64", "amd64")
  if os.environ.get("KVPAGE_NO_NATIVE") == "1" or not built_here:
    # An earlier editable install's library would still load: not built means not there.
    stale = HERE / NATIVE_DIR / ("_kernels" + sysconfig.get_config_var("EXT_SUFFIX"))
    if stale.exists():
      stale.unlink()
    return []
  return [setuptools.Extension(
      NATIVE, sources=[f"{NATIVE_DIR}/{name}" for name in (DISPATCH, *KERNELS)],
      depends=[f"{NATIVE_DIR}/{name}" for name in (*HEADERS, LIMITS)], language="c++")]


SERVE = [
    "fastapi>=0.110",
    "uvicorn>=0.54,<0.56",  # kvpage.serve.server subclasses its httptools protocol
    "httptools>=0.6",  # uvicorn's fast HTTP parser
    "prometheus_client>=0.20",
    "transformers>=4.45",
    "tokenizers>=0.19",
    "jinja2>=3.1",  # chat templates
    "aiohttp>=3.9",  # benchmarks/serve_http.py's load client, the server's companion
]
# The fleet (`python -m experiments.serve --replicas=N`, kvpage.serve.ray_fleet): Ray
# Serve, pinned, as its request-router API is alpha (one adapter module uses it).
FLEET = ["ray[serve]==2.60.0"]
# The figures (experiments/plots.py) and the notebooks; nbclient + ipykernel run them
# headless (the tests do), Jupyter opens them.
NOTEBOOKS = [
    "matplotlib>=3.8",
    "nbformat>=5.9",
    "nbclient>=0.10",
    "nbconvert>=7",  # CI renders the executed notebooks to HTML (tests/test_notebooks.py)
    "ipykernel>=6.29",
]

setuptools.setup(
    name="kvpage",
    version="0.1.0",
    description=(
        "A JAX research framework for LLM serving under load: paged KV cache, "
        "token-level admission control, continuous batching."
    ),
    python_requires=">=3.10",
    # The JAX range CI proves (.ci/run): jax 0.10.2 on Python 3.11, 0.11.2 (the kernel
    # tests) and 0.12.0.1 on Python 3.12, each with flax 0.12.
    packages=setuptools.find_packages(include=["kvpage*", "models*", "configs*", "experiments*"]),
    # The CPU kernels' library, compiled at install time (`BuildNative`, above).
    ext_modules=_native_extensions(),
    cmdclass={"build_ext": BuildNative},
    install_requires=[
        "jax>=0.10.2,<0.13",
        "jaxlib>=0.10.2,<0.13",
        "flax>=0.12.8,<0.13",
        "optax>=0.2",
        "numpy>=1.26",
        "scipy>=1.11",  # the simulator's calibration fit (kvpage.sim.calibration)
        "absl-py>=2.0",
        "ml-collections>=1.0",
        "safetensors>=0.4",
        "rich>=13",  # progress bars
    ],
    extras_require={
        # The streaming gateway (`python -m experiments.serve`); transformers for its
        # tokenizer and chat templates only (it loads no torch).
        "serve": SERVE,
        "fleet": [*SERVE, *FLEET],
        "notebooks": [*NOTEBOOKS, "jupyterlab>=4"],
        "test": [
            *SERVE,
            *FLEET,  # tests/test_ray_fleet.py: a local Ray cluster
            *NOTEBOOKS,
            "openai>=1.40",  # the official client, driven against the server in tests
            "httpx>=0.27",
            "pytest>=8",
            "pytest-xdist>=3.5",  # `pytest -n 2`: two workers, the suite in ~3/4 of the time
            "hypothesis>=6.100",
            "chex>=0.1.90",
            "ruff>=0.6",
            "mypy>=1.11",
            # Test-time references only (parity checks), never imported by kvpage:
            # torch 2.13.0's CPU build is the one these machines carry, for Python 3.11
            # only; on newer Pythons the torch parity tests skip.
            "torch==2.13.0; python_version < '3.12'",
        ],
    },
)
