r"""kvpage's Pallas paged-attention kernels on a GPU: check them, then time decode.

  python -m benchmarks.kernel_gpu --out=kernel_gpu.json         # one command, GPU machine
  python -m benchmarks.kernel_gpu --interpret --out=/tmp/k.json  # CPU smoke test

One run, three parts, each printed and written to one JSON record with its premises
(device, JAX/jaxlib versions, dtype, shapes, page size, repeats):

1. **Correctness on the device.** Each kernel (`decode_attention`, `mosaic_decode` (the
   Mosaic GPU decode kernel), `ragged_attention`, and the `paged_attention` entry point
   that dispatches between them) against
   `kvpage.device.attention.reference.ragged_paged_attention` on random ragged batches with permuted
   pages, partial last pages and lengths 1/3/17/513, in bf16 and fp32. The oracle
   runs in fp32 at "highest" matmul precision (XLA on GPU would otherwise use TF32).
   Pass: relative error < 1e-5 (fp32), < 2e-2 (bf16), the bars of tests/test_kernels.py.
2. **Copy bandwidth.** A jitted device-to-device copy of `--copy_mib` MiB; bytes
   moved (read + write) / median time is the practical HBM ceiling of this run.
3. **Decode timing.** Batch x context cells (default 1/8/64/256 x 512/4096/32768,
   32 query heads, 8 KV heads, head_dim 128, bf16, page size 16, randomly permuted
   pages). Per cell, the median of `--repeats` calls after warm-up of: the Triton
   decode kernel; the Mosaic GPU decode kernel; the reference gather path; JAX's own
   `jax.experimental.pallas.ops.gpu.paged_attention` ("n/a: <reason>" where it no
   longer runs). Achieved bandwidth = KV bytes the step must read / time, shown
   against the copy bandwidth. Cells that do not fit device memory, or that start
   after `--time_budget_s`, are skipped with a note.

4. **End to end.** The tiny model with `attention_impl` `xla`, `pallas` and `mosaic`:
   `experiments.generate`'s greedy tokens (equal to xla's?) and a short
   `experiments.serve_bench` (32 requests of 64 + 32 tokens at once; on a GPU its pool
   sized by the memory plan), then the plan's terms beside the device's own memory
   figures once a planned pool is allocated.

With `--interpret` the kernels run in the Pallas interpreter and the shapes default to
small ones (override any with its flag): that checks the script, not the GPU.
"""

import functools
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from benchmarks import timing
from experiments import cli
from kvpage import premises
from kvpage.device.attention import reference
from kvpage.device.backends.pallas import attention as paged_attention
from kvpage.device.backends.pallas import decode as decode_attention
from kvpage.device.backends.pallas import mosaic_decode
from kvpage.device.backends.pallas import ragged as ragged_attention

_OUT = flags.DEFINE_string("out", "kernel_gpu.json", "Where to write the JSON record.")
_REPEATS = flags.DEFINE_integer("repeats", 50, "Timed calls per cell (median reported).")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed calls per cell before timing.")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Pallas interpreter + small shapes (CPU).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "64", "256"], "Decode batch sizes.")
_CONTEXTS = flags.DEFINE_list("contexts", ["512", "4096", "32768"], "Context lengths.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 32, "Query heads.")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dimension.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
_DTYPE = flags.DEFINE_enum("dtype", "bf16", ["bf16", "fp16", "fp32"], "Timed dtype.")
_COPY_MIB = flags.DEFINE_integer("copy_mib", 2048, "Size of the copy-bandwidth buffer.")
_TIME_BUDGET = flags.DEFINE_float("time_budget_s", 240.0, "Skip cells starting later.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_END_TO_END = flags.DEFINE_bool("end_to_end", True, "Part 4: the tiny model's generate and "
                                "a short serve_bench with each attention implementation.")

# Smaller defaults under --interpret (flags given explicitly still win).
_INTERPRET_DEFAULTS = dict(batches=["1", "4"], contexts=["32", "160"], num_heads=8,
                           num_kv_heads=2, head_dim=16, copy_mib=16, repeats=3, warmup=1)
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
TOLERANCES = {"bf16": 2e-2, "fp32": 1e-5}
CHECK_SEQS = {"decode": [(1, 1), (3, 1), (16, 1), (17, 1), (513, 1), (1000, 1)],
              "mixed": [(513, 1), (17, 17), (40, 7), (3, 1), (300, 129)]}


def setting(name: str):
  """A flag's value, or its small interpret-mode default when not given explicitly."""
  holder = flags.FLAGS[name]
  if _INTERPRET.value and not holder.present and name in _INTERPRET_DEFAULTS:
    return _INTERPRET_DEFAULTS[name]
  return holder.value


def failure(error: BaseException) -> str:
  lines = [line for line in str(error).splitlines() if line.strip()]
  return f"n/a: {type(error).__name__}: {lines[-1][:300] if lines else ''}"


def random_case(seqs, num_heads, num_kv_heads, head_dim, page_size, rng):
  """Host arrays of a ragged batch: permuted pages, garbage in unused slots, 1 pad token."""
  pages_needed = [-(-ctx // page_size) for ctx, _ in seqs]
  num_pages = 1 + sum(pages_needed) + 2
  order = rng.permutation(np.arange(1, num_pages))
  tables = np.zeros((len(seqs), max(pages_needed)), np.int32)
  for s, n in enumerate(pages_needed):
    tables[s, :n], order = order[:n], order[n:]
  shape = (num_kv_heads, num_pages, page_size, head_dim)
  num_tokens = sum(q for _, q in seqs)
  return dict(
      q=rng.standard_normal((num_tokens + 1, num_heads, head_dim)),
      k_pages=rng.standard_normal(shape), v_pages=rng.standard_normal(shape),
      page_tables=tables, context_lens=np.array([c for c, _ in seqs], np.int32),
      query_start_loc=np.concatenate([[0], np.cumsum([q for _, q in seqs])]).astype(np.int32))


# Timed decode implementations: the Triton kernel, the Mosaic GPU kernel, the reference,
# and JAX's own Pallas GPU paged attention.
IMPLEMENTATIONS = ("pallas_decode", "mosaic_decode", "reference", "jax_pallas_gpu")


def kernel_calls(interpret: bool) -> dict:
  """The kernels under test, each with the reference's calling convention."""

  def decode(q, k, v, *, page_tables, context_lens, query_start_loc):
    del query_start_loc  # The decode check batches hold exactly one token per sequence.
    return decode_attention.paged_decode_attention(
        q[:-1], k, v, page_tables=page_tables, context_lens=context_lens,
        interpret=interpret)

  def mosaic(q, k, v, *, page_tables, context_lens, query_start_loc):
    del query_start_loc  # as `decode`
    return mosaic_decode.paged_decode_attention(
        q[:-1], k, v, page_tables=page_tables, context_lens=context_lens,
        interpret=interpret)

  return {"decode_attention": ("decode", decode), "mosaic_decode": ("decode", mosaic),
          "ragged_attention": ("mixed", functools.partial(
              ragged_attention.ragged_mixed_attention, interpret=interpret)),
          "paged_attention(decode)": ("decode", functools.partial(
              paged_attention.ragged_paged_attention, interpret=interpret)),
          "paged_attention(mixed)": ("mixed", functools.partial(
              paged_attention.ragged_paged_attention, interpret=interpret))}


def check_kernels(shape: dict, interpret: bool, rng: np.random.Generator) -> list[dict]:
  """Relative error of every kernel against the fp32 reference, in bf16 and fp32."""
  rows = []
  for dtype_name, tolerance in TOLERANCES.items():
    for kernel, (kind, call) in kernel_calls(interpret).items():
      case = random_case(CHECK_SEQS[kind], rng=rng, **shape)
      inputs = {name: jnp.asarray(x, DTYPES[dtype_name]) if x.dtype == np.float64 else
                jnp.asarray(x) for name, x in case.items()}
      q, k, v = (inputs.pop(name) for name in ("q", "k_pages", "v_pages"))
      with jax.default_matmul_precision("highest"):
        expected = np.asarray(reference.ragged_paged_attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), **inputs), np.float64)
      row = dict(kernel=kernel, dtype=dtype_name, tolerance=tolerance)
      try:
        out = np.asarray(call(q, k, v, **inputs).astype(jnp.float32), np.float64)
        real = int(case["query_start_loc"][-1])
        row["relative_error"] = float(np.max(np.abs(out[:real] - expected[:real]))
                                      / np.max(np.abs(expected[:real])))
        row["passed"] = bool(row["relative_error"] < tolerance and np.all(np.isfinite(out)))
      except Exception as error:  # report it, carry on to the timings
        row.update(relative_error=None, passed=False, error=failure(error))
      rows.append(row)
      print(f"  {kernel:<24} {dtype_name:<5} rel err {row['relative_error']!s:<24} "
            f"{'PASS' if row['passed'] else 'FAIL ' + row.get('error', '')}")
  return rows


def copy_bandwidth(num_mib: int, repeats: int, warmup: int) -> dict:
  """Bytes moved (read + write) per second by a jitted device-to-device copy."""
  buffer = jnp.ones((num_mib * 2**20 // 4,), jnp.float32)
  copy = jax.jit(jnp.copy)  # a fresh output buffer: XLA must read and write every byte
  stats = timing.time_call(lambda: copy(buffer).block_until_ready(), repeats=repeats,
                           warmup=warmup)
  return dict(bytes=num_mib * 2**20, median_s=stats["median_s"],
              gb_per_s=2 * num_mib * 2**20 / stats["median_s"] / 1e9)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def random_pool(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
  """Random pages: a normal block of <= 2**24 values tiled along the page axis.

  Cheap at 34 GB, and keeps the generator well under 2**32 values per call.
  """
  num_kv_heads, num_pages, page_size, head_dim = shape
  base_pages = max(1, min(num_pages, 2**24 // (num_kv_heads * page_size * head_dim)))
  base = jax.random.normal(key, (num_kv_heads, base_pages, page_size, head_dim), dtype)
  return jnp.tile(base, (1, -(-num_pages // base_pages), 1, 1))[:, :num_pages]


def decode_inputs(batch: int, context: int, shape: dict, dtype, seed: int) -> dict:
  """Device arrays of one decode cell: random q/K/V, a random page permutation."""
  num_kv_heads, page_size, head_dim = shape["num_kv_heads"], shape["page_size"], shape[
      "head_dim"]
  pages_per_seq = -(-context // page_size)
  num_pages = 1 + batch * pages_per_seq
  keys = jax.random.split(jax.random.key(seed), 4)
  pool = (num_kv_heads, num_pages, page_size, head_dim)
  tables = jax.random.permutation(keys[3], jnp.arange(1, num_pages, dtype=jnp.int32))
  return dict(
      q=jax.random.normal(keys[0], (batch, shape["num_heads"], head_dim), dtype),
      k_pages=random_pool(keys[1], pool, dtype), v_pages=random_pool(keys[2], pool, dtype),
      page_tables=tables.reshape(batch, pages_per_seq),
      context_lens=jnp.full((batch,), context, jnp.int32))


def jax_op_call(inputs: dict, interpret: bool):
  """JAX's Triton paged-attention op (it leaves 1/sqrt(d) to the caller)."""
  from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

  pages_per_seq = inputs["page_tables"].shape[1]
  k_splits = math.gcd(pages_per_seq, 16)
  scale = 1.0 / math.sqrt(inputs["q"].shape[-1])
  fn = jax.jit(lambda q, k, v, bt, cl: jax_paged.paged_attention(
      (q * scale).astype(q.dtype), k, v, bt, cl, k_splits=k_splits, interpret=interpret))
  return lambda: fn(*inputs.values())


def time_cell(batch: int, context: int, shape: dict, dtype, interpret: bool,
              repeats: int, warmup: int) -> dict:
  """Median seconds and KV-read bandwidth of each decode implementation in one cell."""
  inputs = decode_inputs(batch, context, shape, dtype, _SEED.value)
  decode = jax.jit(functools.partial(decode_attention.paged_decode_attention,
                                     interpret=interpret))
  oracle = jax.jit(reference.ragged_paged_attention)
  qsl = jnp.arange(batch + 1, dtype=jnp.int32)
  q, k, v, bt, cl = inputs.values()
  mosaic = jax.jit(functools.partial(mosaic_decode.paged_decode_attention,
                                     interpret=interpret))
  calls = {"pallas_decode": lambda: decode(q, k, v, page_tables=bt, context_lens=cl),
           "mosaic_decode": lambda: mosaic(q, k, v, page_tables=bt, context_lens=cl),
           "reference": lambda: oracle(q, k, v, page_tables=bt, context_lens=cl,
                                       query_start_loc=qsl)}
  kv_bytes = 2 * batch * context * shape["num_kv_heads"] * shape["head_dim"] * jnp.dtype(
      dtype).itemsize
  row = dict(batch=batch, context=context, kv_bytes=kv_bytes)
  for name in IMPLEMENTATIONS:
    try:
      call = calls[name] if name in calls else jax_op_call(inputs, interpret)
      stats = timing.time_call(lambda call=call: call().block_until_ready(), repeats=repeats,
                               warmup=warmup)
      row[name] = dict(median_s=stats["median_s"], p90_s=stats["p90_s"],
                       gb_per_s=kv_bytes / stats["median_s"] / 1e9)
    except Exception as error:  # a failing implementation is a result
      row[name] = failure(error)
  return row


def fits_in_memory(batch: int, context: int, shape: dict, itemsize: int) -> str | None:
  """None if a cell's pools (and headroom for the reference's gathers) fit, else a note."""
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" not in stats:
    return None
  free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  pages = 1 + batch * -(-context // shape["page_size"])
  need = 2 * pages * shape["page_size"] * shape["num_kv_heads"] * shape["head_dim"] * itemsize
  if 1.25 * need > free:
    return f"skipped: needs ~{1.25 * need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
  return None


def print_cell(row: dict, copy_gb_per_s: float) -> None:
  cells = []
  for name in IMPLEMENTATIONS:
    result = row.get(name)
    if isinstance(result, dict):
      cells.append(f"{result['median_s'] * 1e3:>9.3f} ms {result['gb_per_s']:>8.1f} GB/s "
                   f"({result['gb_per_s'] / copy_gb_per_s:>5.1%})")
    else:
      cells.append(f"{str(result)[:44]:<44}")
  print(f"{row['batch']:>6} {row['context']:>7} {row['kv_bytes'] / 2**20:>10.1f}  "
        + " | ".join(cells))


def end_to_end(interpret: bool) -> dict:
  """The tiny model on this device with each attention implementation: `generate`'s
  greedy tokens and a short `serve_bench`, each in a process of its own; then the memory
  plan's terms beside what the device reports once a planned pool is allocated."""
  pool = [] if interpret else ["--config.cache.kv_memory_gib=0"]  # GPU: the plan sizes it
  runs = {}
  for impl in ("xla", "pallas", "mosaic"):
    impl_flag = f"--config.model.attention_impl={impl}"
    generate = subprocess.run(
        [sys.executable, "-m", "experiments.generate", "--config=configs/tiny.py", impl_flag,
         "--prompt_ids=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17;7,3;42",
         "--max_new_tokens=16"], capture_output=True, text=True, timeout=900)
    run = dict(generate_rc=generate.returncode,
               tokens=[json.loads(line)["output_ids"] for line in generate.stdout.splitlines()
                       if line.startswith("{")],
               generate_error=generate.stderr.strip().splitlines()[-1:] if
               generate.returncode else [])
    with tempfile.TemporaryDirectory() as workdir:
      bench = subprocess.run(
          [sys.executable, "-m", "experiments.serve_bench", "--config=configs/tiny.py",
           impl_flag, *pool, "--num_requests=32", "--arrival_rate=inf", "--prompt_len=64",
           "--output_len=32", f"--workdir={workdir}", "--compilation_cache="],
          capture_output=True, text=True, timeout=1800)
      run["serve_bench_rc"] = bench.returncode
      if bench.returncode == 0:
        summary = json.loads((pathlib.Path(workdir) / "summary.json").read_text())
        run.update(ttft_p50_s=summary["ttft_s"]["p50"], tpot_p50_s=summary["tpot_s"]["p50"],
                   output_tokens_per_s=summary["output_tokens_per_s"],
                   memory_plan=summary["premises"].get("memory_plan"))
      else:
        run["serve_bench_error"] = bench.stderr.strip().splitlines()[-1:]
    runs[impl] = run
    print(f"  {impl:<8} generate rc {run['generate_rc']} tokens == xla: "
          f"{run['tokens'] == runs['xla']['tokens']}; serve_bench rc {run['serve_bench_rc']}"
          + (f", TTFT p50 {1e3 * run['ttft_p50_s']:.1f} ms, TPOT p50 "
             f"{1e3 * run['tpot_p50_s']:.2f} ms, {run['output_tokens_per_s']:,.0f} tok/s"
             if "ttft_p50_s" in run else f" {run.get('serve_bench_error')}"))
  return dict(runs=runs, memory=memory_against_device(interpret))


def memory_against_device(interpret: bool) -> dict:
  """The memory plan of the tiny model's serving setup, then the device's own figures
  after the planned pool and the weights are allocated (an accelerator only)."""
  from configs import hardware as hardware_lib
  from configs import tiny

  config = tiny.get_config()
  stats = jax.devices()[0].memory_stats() or {}
  if interpret or "bytes_limit" not in stats:
    print("  memory: this device reports no memory figures")
    return dict(note="no device memory statistics")
  config.cache.num_pages, config.cache.kv_memory_gib = 0, 0.0
  setup = cli.serving_engine(config, executor="jax",
                             hardware=hardware_lib.get_hardware(config.hardware))
  after = jax.devices()[0].memory_stats()
  plan = setup.memory_plan.to_dict() if setup.memory_plan else {}
  print(f"  memory plan: {setup.memory_plan.lines() if setup.memory_plan else 'none'}")
  print(f"  device after allocation: in use {after.get('bytes_in_use', 0) / 2**30:.2f} GiB, "
        f"peak {after.get('peak_bytes_in_use', 0) / 2**30:.2f} GiB, limit "
        f"{after['bytes_limit'] / 2**30:.2f} GiB")
  return dict(plan=plan, device_before=stats, device_after=after)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  start, interpret, rng = time.perf_counter(), _INTERPRET.value, np.random.default_rng(
      _SEED.value)
  shape = {name: setting(name) for name in ("num_heads", "num_kv_heads", "head_dim",
                                            "page_size")}
  repeats, warmup, dtype = setting("repeats"), setting("warmup"), DTYPES[_DTYPE.value]
  device = jax.devices()[0]
  print(f"device {device.device_kind} ({device.platform}), jax {jax.__version__}, "
        f"interpret={interpret}, shapes {shape}, timed dtype {_DTYPE.value}")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    print("1. kernels vs the reference on this device")
    checks = check_kernels(shape, interpret, rng)
    copy = copy_bandwidth(setting("copy_mib"), repeats, warmup)
    print(f"2. device-to-device copy: {copy['gb_per_s']:.1f} GB/s (read + write)")
    print(f"3. decode, median of {repeats}; GB/s = KV bytes read / time (% of copy)\n"
          f"{'batch':>6} {'context':>7} {'KV MiB':>10}  "
          + " | ".join(f"{name:<38}" for name in IMPLEMENTATIONS))
    cells = []
    for batch in map(int, setting("batches")):
      for context in map(int, setting("contexts")):
        note = fits_in_memory(batch, context, shape, jnp.dtype(dtype).itemsize)
        if note is None and time.perf_counter() - start > _TIME_BUDGET.value:
          note = f"skipped: past --time_budget_s={_TIME_BUDGET.value:.0f}"
        row = (dict(batch=batch, context=context, note=note) if note else
               time_cell(batch, context, shape, dtype, interpret, repeats, warmup))
        if note:
          print(f"{batch:>6} {context:>7} {note}")
        else:
          print_cell(row, copy["gb_per_s"])
        cells.append(row)
  print("4. the tiny model end to end with each attention implementation")
  model_runs = end_to_end(interpret) if _END_TO_END.value else None
  record = dict(
      benchmark="kernel_gpu",
      premises=dict(device=str(device), device_kind=device.device_kind,
                    device_platform=device.platform, jax=jax.__version__, interpret=interpret,
                    dtype=_DTYPE.value, **shape, repeats=repeats, warmup=warmup,
                    seed=_SEED.value, **premises.environment()),
      correctness=checks, all_passed=all(row["passed"] for row in checks), copy=copy,
      decode=cells, end_to_end=model_runs, warnings=sorted({str(w.message)[:300] for w in caught}),
      elapsed_s=time.perf_counter() - start)
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=2)
  print(f"all kernel checks passed: {record['all_passed']}; {record['elapsed_s']:.0f} s; "
        f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
