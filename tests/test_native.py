"""The native kernels' library as installed (`kvpage.device.backends.cpu.native`).

`pip install -e .` compiles it once (setup.py): one file holding the kernels in three
variants (avx2, avx512, amx) and a dispatcher built for any x86-64 CPU. These tests tie
it to the Python side: the limits compiled into it are `limits.py`'s, every FFI target
has a handler in every variant, the variant loaded is the one this CPU's features call
for, each variant this CPU runs matches a float64 oracle on small attention and product
cases (in a subprocess each, under `KVPAGE_NATIVE_VARIANT`), nothing is compiled when it
runs (a subprocess with no compiler on PATH), no variant's code can reach instructions
beyond its own, and the refusals say why and leave everything on XLA.
"""

import collections
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from kvpage.device.backends.cpu import attention, limits, linear, native

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cpu_flags() -> set[str]:
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return set()
  line = next((line for line in text.splitlines() if line.startswith("flags")), "")
  return set(line.partition(":")[2].split())


def _expected_variant() -> str | None:
  """The variant this CPU's features call for, read from /proc/cpuinfo."""
  flags = _cpu_flags()
  if not {"avx2", "fma"} <= flags:
    return None
  if not {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= flags:
    return "avx2"
  return "amx" if {"avx512_bf16", "amx_tile", "amx_bf16"} <= flags else "avx512"


def _library():
  assert native.status() == "ready", native.status()
  return native._state()[0].library


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, **env})


def test_the_library_is_built_and_loads_the_variant_this_cpu_calls_for():
  record = native.describe()
  assert record["status"] == "ready"
  expected = os.environ.get(native.VARIANT_ENV) or _expected_variant()
  assert record["variant"] == expected == native.variant()
  assert record["amx"] == (record["variant"] == "amx") == native.amx()
  assert record["library"] == native.library_path().name
  assert "/" not in record["library"] and record["library"].startswith("_kernels")
  assert record["jaxlib"] and record["ffi_api"] and record["compiler"]
  flags = record["flags"].split()
  assert "-O3" in flags and "-fassociative-math" in flags and "-ffast-math" not in flags
  assert "-march=native" not in flags
  assert ("-mavx512f" in flags) == (record["variant"] != "avx2")
  assert ("-mamx-tile" in flags) == (record["variant"] == "amx")


def test_the_limits_compiled_into_the_library_are_limits_py():
  values = native.library_limits(_library())
  assert values == {"HEAD_DIMS": limits.HEAD_DIMS, "MAX_GROUP": limits.MAX_GROUP,
                    "PANEL": limits.PANEL,
                    "BF16X3_HEAD_DIM_MULTIPLE": limits.BF16X3_HEAD_DIM_MULTIPLE}
  # The wrappers' constants are limits.py's.
  assert attention.MAX_GROUP == limits.MAX_GROUP and attention.HEAD_DIMS == limits.HEAD_DIMS
  assert linear.PANEL == limits.PANEL
  assert _library().KvpageLimit(b"NO_SUCH_LIMIT", -1) == -(2**63)


def test_every_target_has_a_handler_in_every_variant():
  library = _library()
  assert native.TARGETS is limits.TARGETS and native.VARIANTS == ("avx2", "avx512", "amx")
  handlers = {(symbol, variant): library.KvpageHandler(symbol.encode(), variant.encode())
              for symbol in native.TARGETS.values() for variant in native.VARIANTS}
  assert all(handlers.values()), [key for key, handler in handlers.items() if not handler]
  assert len(set(handlers.values())) == len(handlers)  # each variant its own code
  assert not library.KvpageHandler(b"KvpageLinear", b"sse2")
  assert not library.KvpageHandler(b"NoSuchHandler", b"avx2")
  for flags in map(library.KvpageBuild, (v.encode() for v in native.VARIANTS)):
    assert flags and b"-march" not in flags


def test_the_build_pins_the_oldest_jaxlib_install_allows():
  tomllib = pytest.importorskip("tomllib")
  requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
  pinned = [r.split("==")[1] for r in requires if r.startswith("jaxlib==")]
  oldest = re.findall(r'"jaxlib>=([\d.]+),', (ROOT / "setup.py").read_text())
  assert pinned and pinned == oldest, (pinned, oldest)


# Small cases against a float64 oracle: decode (a padding row), a prompt chunk over a
# cached prefix beside a decode (whose rows stay zero), products and SwiGLU. Asserts
# inside; prints describe().
CHECK = """
import json, shutil
import jax.numpy as jnp
import numpy as np
from kvpage.device.backends.cpu import attention, linear, native

rng = np.random.default_rng(0)
L, KVH, H, D, P, PS, layer, scale = 2, 2, 4, 32, 16, 4, 1, 0.3
k = rng.standard_normal((L, KVH, P, PS, D)).astype(np.float32)
v = rng.standard_normal((L, KVH, P, PS, D)).astype(np.float32)
tables = rng.permutation(P).reshape(2, 8).astype(np.int32)

def attend(q, seq, keys):
  out = np.zeros((H, D))
  for h in range(H):
    kv, pos = h // (H // KVH), np.arange(keys)
    kk = k[layer, kv, tables[seq, pos // PS], pos % PS].astype(np.float64)
    vv = v[layer, kv, tables[seq, pos // PS], pos % PS].astype(np.float64)
    s = kk @ q[h].astype(np.float64) * scale
    w = np.exp(s - s.max())
    out[h] = w @ vv / w.sum()
  return out

q = rng.standard_normal((2, H, D)).astype(np.float32)
lims = np.array([13, 0], np.int32)
out = np.asarray(attention.paged_decode(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                 jnp.asarray(tables), jnp.asarray(lims), layer=layer, sm_scale=scale))
np.testing.assert_allclose(out[0], attend(q[0], 0, 13), rtol=1e-4, atol=2e-5)
assert not out[1].any()

qp = rng.standard_normal((6, H, D)).astype(np.float32)  # 5 new tokens at 8..12, a decode
out = np.asarray(attention.paged_prefill(
    jnp.asarray(qp), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables),
    jnp.asarray([0, 5, 6], jnp.int32), jnp.asarray([13, 1], jnp.int32), layer=layer,
    sm_scale=scale))
for i in range(5):
  np.testing.assert_allclose(out[i], attend(qp[i], 0, 9 + i), rtol=1e-4, atol=2e-5)
assert not out[5].any()

x = rng.standard_normal((5, 64)).astype(np.float32)
w1, w2, w3 = (rng.standard_normal((64, n)).astype(np.float32) for n in (32, 96, 96))
assert linear.target(5, 96, np.float32) == "kvpage_linear"
outs = linear.project(jnp.asarray(x), [jnp.asarray(w1), jnp.asarray(w2)])
for got, w in zip(outs, (w1, w2)):
  np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
got = linear.swiglu(jnp.asarray(x), jnp.asarray(w2), jnp.asarray(w3))
gate, up = x.astype(np.float64) @ w2, x.astype(np.float64) @ w3
np.testing.assert_allclose(got, gate / (1 + np.exp(-gate)) * up, rtol=1e-4, atol=1e-4)
print(json.dumps(dict(native.describe(), compilers=[shutil.which(c) for c in
                                                     ("g++", "c++", "gcc", "cc")])))
"""


@pytest.mark.parametrize("variant", native.VARIANTS)
def test_each_variant_this_cpu_runs_matches_the_oracle(variant):
  if _library().KvpageRuns(variant.encode()) != 1:
    pytest.skip(f"this CPU does not run the {variant} variant")
  result = _run(CHECK, KVPAGE_NATIVE_VARIANT=variant)
  assert result.returncode == 0, result.stderr[-3000:]
  record = json.loads(result.stdout.splitlines()[-1])
  assert (record["status"], record["variant"]) == ("ready", variant)


def test_nothing_is_compiled_at_run_time(tmp_path):
  """The kernels run with no compiler on PATH and write no build cache."""
  empty = tmp_path / "bin"
  empty.mkdir()
  cache = tmp_path / "cache"
  result = _run(CHECK, PATH=str(empty), CXX=str(empty / "g++"), HOME=str(tmp_path),
                KVPAGE_CACHE_DIR=str(cache))
  assert result.returncode == 0, result.stderr[-3000:]
  record = json.loads(result.stdout.splitlines()[-1])
  assert record["status"] == "ready" and record["compilers"] == [None] * 4
  assert not cache.exists() and not list(tmp_path.rglob("*.so"))


def test_refusals_say_why_and_leave_the_products_and_attention_to_xla():
  code = """
  import json, os
  import numpy as np
  from kvpage.device.backends.cpu import attention, limits, linear, native

  def attempt(**changes):
    native._state.cache_clear()
    native.amx.cache_clear()
    status = native.status()
    assert native.variant() is None and not native.amx() and not native.bf16x3("high")
    assert linear.target(8, 64, np.float32) is None
    assert not attention.runs(np.float32, 1, 64) and not attention.prefill_runs(np.float32, 64)
    return status

  runs_amx = native._load().library.KvpageRuns(b"amx") == 1
  reasons = {}
  os.environ["KVPAGE_NATIVE_VARIANT"] = "sse2"
  reasons["unknown variant"] = attempt()
  if not runs_amx:
    os.environ["KVPAGE_NATIVE_VARIANT"] = "amx"
    reasons["variant this CPU does not run"] = attempt()
  del os.environ["KVPAGE_NATIVE_VARIANT"]
  limits.MAX_GROUP = 8
  reasons["other limits"] = attempt()
  limits.MAX_GROUP = 16
  native.library_path = lambda: None
  reasons["not built"] = attempt()
  print(json.dumps(reasons))
  """
  result = _run(code)
  assert result.returncode == 0, result.stderr[-3000:]
  reasons = json.loads(result.stdout.splitlines()[-1])
  assert reasons["unknown variant"].startswith("unavailable: KVPAGE_NATIVE_VARIANT='sse2'")
  if "variant this CPU does not run" in reasons:
    assert "does not run the amx variant" in reasons["variant this CPU does not run"]
  assert "built from other sources: its MAX_GROUP is 16" in reasons["other limits"]
  assert reasons["not built"].startswith("unavailable: the native extension was not built")
  assert "KVPAGE_NO_NATIVE=1" in reasons["not built"]
  # One warning per refusal, naming the reason.
  assert result.stderr.count("kvpage's CPU kernels are unavailable") == len(reasons)


# Instruction encodings: EVEX (AVX-512) opens with 0x62 in 64-bit code, VEX (AVX, AVX2,
# FMA, and the AMX tile instructions) with 0xc4 or 0xc5, after any legacy prefixes.
_PREFIXES = {0x66, 0x67, 0xf2, 0xf3, 0x2e, 0x36, 0x3e, 0x26, 0x64, 0x65, 0xf0}
_VARIANT_TAG = re.compile(r"variant_(avx512|avx2|amx)|Kvpage\w*?_(avx512|avx2|amx)(?![0-9a-z])")


def _encodings(path: pathlib.Path) -> dict[str, set[str]]:
  """Each function of `path` (mangled name): the encodings among its instructions."""
  text = subprocess.run(["objdump", "-d", "-w", str(path)], capture_output=True, text=True,
                        check=True).stdout
  functions: dict[str, set[str]] = collections.defaultdict(set)
  name = None
  for line in text.splitlines():
    header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
    if header:
      name = header.group(1)
      functions[name]
      continue
    fields = line.split("\t")
    if name is None or len(fields) < 3 or not fields[2].strip():
      continue
    code = [int(byte, 16) for byte in fields[1].split()]
    first = next((byte for byte in code if byte not in _PREFIXES), None)
    mnemonic = fields[2].split()[0]
    if mnemonic.startswith(("tile", "tdp", "ldtilecfg", "sttilecfg")):
      functions[name].add("amx")
    elif first == 0x62:
      functions[name].add("evex")
    elif first in (0xc4, 0xc5):
      functions[name].add("vex")
  return functions


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump here")
def test_no_variant_reaches_instructions_beyond_its_own():
  """Each function's instructions against the variant its name says it belongs to:
  AVX-512 only in the avx512 and amx variants, AMX only in the amx one, and no AVX at all
  in what runs on any CPU (dispatch.cc, the static initializers). The functions the
  variants share (the C++ library's, XLA's) are the AVX2 variant's (linked first)."""
  functions = _encodings(native.library_path())
  allowed = {None: {"vex"}, "avx2": {"vex"}, "avx512": {"vex", "evex"},
             "amx": {"vex", "evex", "amx"}}
  wrong, tagged = [], collections.Counter()
  for name, found in functions.items():
    match = _VARIANT_TAG.search(name)
    tag = (match.group(1) or match.group(2)) if match else None
    tagged[tag] += 1
    baseline = name.startswith(("_GLOBAL__sub_I", "_ZN6kvpage8dispatch")) or (
        name.startswith("Kvpage") and tag is None)
    if found - (set() if baseline else allowed[tag]):
      wrong.append((name, tag, sorted(found)))
  assert not wrong, wrong
  assert all(tagged[variant] > 10 for variant in native.VARIANTS), tagged
  assert {"KvpageRuns", "KvpageHandler", "KvpageAmxAvailable"} <= set(functions)
