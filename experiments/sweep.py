r"""A grid of serve_bench runs over any config keys and serve_bench flags, resumable.

  python -m experiments.sweep --executor=sim --config=configs/llama_13b.py \
      --hardware=a100_80gb --num_requests=300 --prompt_len=mix:0.1:3000:200 \
      --sweep=scheduler.prefill_policy=none,chunked --sweep=chunk_size=256,512,2048 \
      --sweep=arrival_rate=1,2,4,8 --seeds=3 --workdir=workdir/sweep/prefill --plot

Every serve_bench flag sets the base run (the config: each flag writes its entry); each
`--sweep=KEY=V1,V2,...` turns one key, and the grid is their product times `--seeds`
seeds (the base `--seed` and the ones after it). A KEY is a serve_bench flag
(`arrival_rate` is `bench.arrival_rate`, `num_pages` is `cache.num_pages`, ...), a
scheduler shortcut (`chunk_size` is `scheduler.chunk_size`) or any config path
(`scheduler.watermark`, `cache.page_size`, `model.dtype`); values are typed and checked
like the flag or the config value they replace. The whole grid is checked before the
first run: an unknown key, an empty list or a cell no run could take (a chunk larger
than the token budget, say) is one line of error and nothing runs.

Each cell runs in-process through `serve_bench.run_bench` — the same code as a
standalone serve_bench run, so a cell's summary is that run's — on the simulator or the
real model. With `--sweep_workers=N` (N > 1) the cells run N at a time, each in a
worker process of its own (spawned, so no JAX state is forked), for simulated sweeps,
whose runs are pure host work (on this 2-core VM, the line study's smoke scale: 45 -> 32 s).
Real-model cells need the whole machine (each compiles and times steps): keep them at
one worker. A row is appended as its cell ends, whatever the order. `--workdir` gets:

  results.jsonl   one row per run, appended as it ends: the cell (swept values, seed),
                  the flat metrics, the whole summary (with its premises)
  results.csv     the tidy table: one line per run, swept values then metrics
  sweep.json      the base config and the grid; a later run with another base config
                  is refused, one with more values resumes (done cells are skipped)
  curves.png      with --plot: the standard metrics against the load, one line per policy
  runs/CELL_ID/   with --keep_runs: each run's serve_bench files
"""

import concurrent.futures
import csv
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import multiprocessing
import pathlib
import sys
from collections.abc import Callable, Sequence, Set
from typing import Any

import ml_collections
from absl import flags

from experiments import cli, progress, serve_bench
from kvpage import metrics

_SWEEP = flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2,... (repeat for a grid).")
_SEEDS = flags.DEFINE_integer("seeds", 1, "Seeds per cell: --seed, --seed + 1, ...")
_PLOT_X = flags.DEFINE_string("plot_x", None, "The load axis of curves.png (default: "
                              "arrival_rate if swept, else the first numeric swept key).")
_KEEP_RUNS = flags.DEFINE_bool("keep_runs", False, "Keep each run's files in runs/CELL_ID/.")
WORKERS = flags.DEFINE_integer("sweep_workers", 1, "Cells run at once, each in a worker "
                               "process (simulated sweeps; real-model cells need 1).")
flags.FLAGS.set_default("workdir", "workdir/sweep")

MAX_SEEDS = 1000  # runs per cell; a grid is planned whole, in memory, before any runs
RESULTS, TABLE, MANIFEST, CURVES = "results.jsonl", "results.csv", "sweep.json", "curves.png"
# The serve_bench flags a sweep may turn: the settings, and the shortcuts for other
# config entries.
FLAG_KEYS = (*serve_bench.SETTINGS, *serve_bench.CONFIG_SHORTCUTS)
# The figures of a row, flat: name -> how to read it from a serve_bench summary.
METRICS: dict[str, Callable[[dict], Any]] = {
    "num_requests": lambda s: s["num_requests"],
    "num_finished": lambda s: s["num_finished"],
    "num_rejected": lambda s: s["num_rejected"],
    "rejected_429": lambda s: s["rejections"].get("429", 0),
    "rejected_503": lambda s: s["rejections"].get("503", 0),
    "rejected_400": lambda s: s["rejections"].get("400", 0),
    "num_preemptions": lambda s: s["num_preemptions"],
    "max_kv_usage": lambda s: s["max_kv_usage"],
    "queue_wait_p50_s": lambda s: s["queue_wait_s"]["p50"],
    "queue_wait_p99_s": lambda s: s["queue_wait_s"]["p99"],
    "ttft_p50_s": lambda s: s["ttft_s"]["p50"],
    "ttft_p99_s": lambda s: s["ttft_s"]["p99"],
    "tpot_p50_s": lambda s: s["tpot_s"]["p50"],
    "tpot_p99_s": lambda s: s["tpot_s"]["p99"],
    "itl_p99_s": lambda s: s["itl_s"]["p99"],
    "max_stall_s": lambda s: s["itl_s"]["max"],  # the longest gap between two tokens
    "e2e_p50_s": lambda s: s["e2e_s"]["p50"],
    "output_tokens_per_s": lambda s: s["output_tokens_per_s"],
    "prompt_tokens_per_s": lambda s: s["prompt_tokens_per_s"],
    "goodput_requests_per_s": lambda s: s["goodput_requests_per_s"],
    "goodput_fraction": lambda s: s["goodput_fraction"],
    # Weighted by prompt tokens, and per prompt-length class; absent in older summaries.
    "goodput_token_fraction": lambda s: s.get("goodput_token_fraction"),
    **{f"goodput_fraction_prompt_{key}": (
        lambda s, name=name: (s.get("by_prompt_length") or {}).get(name, {}).get(
            "good_fraction")) for name, key in metrics.PROMPT_CLASS_KEYS.items()},
    "prefill_tokens_computed": lambda s: s["prefill_tokens_computed"],
    "recomputed_tokens": lambda s: s["recomputed_tokens"],
    "prefix_hit_rate": lambda s: s.get("prefix_cache", {}).get("hit_rate"),
    "duration_s": lambda s: s["duration_s"],
    # The time-weighted sequences per batch (vLLM's comparison); absent in older summaries.
    "running_batch_mean": lambda s: (s.get("running_batch") or {}).get("mean"),
    "running_batch_p50": lambda s: (s.get("running_batch") or {}).get("p50"),
    "running_batch_p99": lambda s: (s.get("running_batch") or {}).get("p99"),
    "paged_kv_waste": lambda s: (s.get("kv_waste") or {}).get("paged_waste"),
    "contiguous_kv_waste": lambda s: (s.get("kv_waste") or {}).get("contiguous_waste"),
}
DEFAULT_CURVES = ("output_tokens_per_s", "ttft_p99_s", "tpot_p99_s", "max_stall_s",
                  "queue_wait_p99_s", "num_rejected")


def flatten(summary: dict) -> dict[str, Any]:
  """The row's figures, by `METRICS` name."""
  return {name: read(summary) for name, read in METRICS.items()}


@dataclasses.dataclass(frozen=True)
class Axis:
  """One swept key: a serve_bench flag or a config path, and its typed values."""

  key: str  # a serve_bench flag (`FLAG_KEYS`), or a dotted config path
  values: tuple[Any, ...]


def _config_value(config: ml_collections.ConfigDict, path: str) -> Any:
  node: Any = config
  for part in path.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise KeyError(part)
    node = node[part]
  return node


def _typed(text: str, like: Any, key: str) -> Any:
  """`text` as the type of the config value `like` it replaces."""
  if isinstance(like, bool):
    if text.lower() not in ("true", "false", "1", "0"):
      raise ValueError(f"--sweep {key}: {text!r} is not a boolean (true/false)")
    return text.lower() in ("true", "1")
  if isinstance(like, (int, float)):
    try:
      return type(like)(text)
    except ValueError:
      raise ValueError(f"--sweep {key}: {text!r} is not {type(like).__name__}") from None
  if isinstance(like, str) or like is None:
    return text
  raise ValueError(f"--sweep {key}: the config value there is a {type(like).__name__}, "
                   "not a number, boolean or string")


def parse_axis(text: str, config: ml_collections.ConfigDict) -> Axis:
  """`KEY=V1,V2,...` as an `Axis`, its key resolved and its values typed."""
  key, equals, listed = text.partition("=")
  key = key.strip()
  if not equals or not key:
    raise ValueError(f"--sweep={text!r} must be KEY=V1,V2,...")
  values = [value.strip() for value in listed.split(",")]
  if not listed.strip() or any(not value for value in values):
    raise ValueError(f"--sweep {key}: the value list {listed!r} is empty or has an empty item")
  if len(set(values)) < len(values):
    raise ValueError(f"--sweep {key}: the values {listed!r} repeat")
  if key == "seed":
    raise ValueError("--sweep seed: use --seeds=N (seeds --seed, --seed + 1, ...)")
  if key in cli.SCHEDULER_SHORTCUTS:
    key = f"scheduler.{key}"
  if key in FLAG_KEYS:
    parser = flags.FLAGS[key].parser  # the flag's own: its type and its choices
    try:
      return Axis(key, tuple(parser.parse(value) for value in values))
    except (flags.Error, ValueError) as error:
      raise ValueError(f"--sweep {key}: {error}") from None
  try:
    like = _config_value(config, key)
  except KeyError as error:
    raise ValueError(f"--sweep {key}: no serve_bench flag and no config key of that name "
                     f"(the config has no {error.args[0]!r})") from None
  if isinstance(like, ml_collections.ConfigDict):
    raise ValueError(f"--sweep {key}: that is a config section, not a value")
  return Axis(key, tuple(_typed(value, like, key) for value in values))


@dataclasses.dataclass(frozen=True)
class Cell:
  """One run of the grid."""

  values: dict[str, Any]  # swept key -> value, then "seed"
  config: ml_collections.ConfigDict  # the whole run: `serve_bench.run_bench(config)`

  @property
  def cell_id(self) -> str:
    return cell_id(self.values)

  def describe(self) -> str:
    return " ".join(f"{key.split('.')[-1]}={value}" for key, value in self.values.items())


def cell_id(values: dict[str, Any]) -> str:
  return hashlib.sha1(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]


def plan(config: ml_collections.ConfigDict, axes: Sequence[Axis],
         seeds: Sequence[int]) -> list[Cell]:
  """Every cell of the grid `axes` x `seeds`, each checked as its run would check it."""
  keys = [axis.key for axis in axes]
  if len(set(keys)) < len(keys):
    raise ValueError(f"--sweep names a key twice: {sorted(k for k in keys if keys.count(k) > 1)}")
  combinations = [dict(zip(keys, values, strict=True))
                  for values in itertools.product(*(axis.values for axis in axes))]
  return plan_cells(config, combinations, seeds)


def config_path(key: str) -> str:
  """The config entry a swept key names: a serve_bench flag's, else the key itself."""
  return serve_bench.setting_path(key) or key


def plan_cells(config: ml_collections.ConfigDict, combinations: Sequence[dict[str, Any]],
               seeds: Sequence[int], done: Set[str] = frozenset()) -> list[Cell]:
  """A cell per combination (key -> value: a serve_bench flag or a config path) and
  seed (`bench.seed`), each checked as its run would check it: a cell no run could take
  raises `ValueError` naming the cell, before anything runs. Studies whose grid is not
  a product (prefill-first has no chunk size) list their combinations here. A cell whose
  id is in `done` (`done_ids`: it ran) is not checked again: a resumed study of
  thousands of cells would draw each one's workload for nothing."""
  if not seeds:
    raise ValueError("--seeds must be >= 1")
  cells = []
  for combination, seed in itertools.product(combinations, seeds):
    values = dict(combination) | {"seed": seed}
    cell_config = ml_collections.ConfigDict(config.to_dict())
    for key, value in values.items():
      section, _, name = config_path(key).rpartition(".")
      try:
        node = _config_value(cell_config, section) if section else cell_config
      except KeyError as error:
        raise ValueError(f"no config key {key!r} (no {error.args[0]!r})") from None
      node[name] = value
    cell = Cell(values, cell_config)
    if cell.cell_id in done:
      cells.append(cell)
      continue
    try:  # what run_bench would refuse, refused now (on a copy, as run_bench takes one)
      serve_bench.prepare(ml_collections.ConfigDict(cell_config.to_dict()))
    except ValueError as error:
      raise ValueError(f"the cell {cell.describe()} cannot run: {error}") from None
    cells.append(cell)
  return cells


def manifest(config: ml_collections.ConfigDict, cells: Sequence[Cell]) -> dict[str, Any]:
  """The base config (less what the cells change) and the grid, for sweep.json."""
  grid: dict[str, list[Any]] = {}
  for cell in cells:
    for key, value in cell.values.items():
      if value not in grid.setdefault(key, []):
        grid[key].append(value)
  base = _runs_read(config.to_dict())
  for key in grid:
    *sections, name = config_path(key).split(".")
    node = base
    for section in sections:
      node = node[section]
    node.pop(name, None)
  return dict(base=dict(config=base), grid=grid, num_cells=len(cells))


def _runs_read(config: dict[str, Any]) -> dict[str, Any]:
  """`config` less the sections no run reads (`server`: only `experiments.serve` does),
  so a sweep resumes across changes to them."""
  return {key: value for key, value in config.items() if key != "server"}


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
  if isinstance(old, dict) and isinstance(new, dict):
    return [difference for key in sorted(set(old) | set(new))
            for difference in _differences(old.get(key), new.get(key), f"{prefix}{key}.")]
  return [] if old == new else [prefix.rstrip(".")]


def check_manifest(directory: pathlib.Path, record: dict[str, Any]) -> None:
  """Refuses a workdir that holds a sweep of other base settings (its rows would mix)."""
  path = directory / MANIFEST
  if not path.exists():
    return
  old = json.loads(path.read_text())
  old_base = dict(old["base"], config=_runs_read(old["base"].get("config", {})))
  differences = _differences(json.loads(json.dumps(old_base)),
                             json.loads(json.dumps(record["base"])))
  if differences:
    raise ValueError(f"--workdir {directory} holds a sweep of another base config (they "
                     f"differ in {', '.join(differences[:5])}); pass a new --workdir, or the "
                     "same base flags to resume it")


def read_rows(directory: pathlib.Path) -> list[dict[str, Any]]:
  """The rows written so far; a last line cut short by a crash is dropped (and rerun)."""
  path = directory / RESULTS
  if not path.exists():
    return []
  rows, lines = [], path.read_text().splitlines()
  for number, line in enumerate(lines, 1):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      if number < len(lines):
        raise ValueError(f"{path}:{number} is not a JSON row; the results file is "
                         "damaged (remove the line to rerun that cell)") from None
      print(f"note: {path}:{number} is a row cut short (a run that stopped while writing "
            "it); dropped, and its cell runs again", file=sys.stderr, flush=True)
      path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return rows


def done_ids(directory: pathlib.Path) -> set[str]:
  """The ids of the cells whose rows `directory` holds."""
  return {row["cell_id"] for row in read_rows(directory)}


def tidy_table(rows: Sequence[dict[str, Any]]) -> str:
  """The CSV: cell id, swept values, then every metric; one line per run."""
  keys = list(dict.fromkeys(key for row in rows for key in row["cell"]))
  out = io.StringIO()
  writer = csv.writer(out)
  writer.writerow(["cell_id", *keys, *METRICS])
  for row in rows:
    writer.writerow([row["cell_id"], *(row["cell"].get(key) for key in keys),
                     *(row["metrics"].get(name) for name in METRICS)])
  return out.getvalue()


def run_sweep(config: ml_collections.ConfigDict, cells: Sequence[Cell],
              directory: pathlib.Path, *, show_progress: bool = True,
              keep_runs: bool = False) -> list[dict[str, Any]]:
  """`run_cells` in `directory` after checking and writing its sweep.json: the whole of a
  sweep, for studies and notebooks."""
  claim_workdir(directory, config, cells)
  return run_cells(cells, directory, show_progress=show_progress, keep_runs=keep_runs)


def claim_workdir(directory: pathlib.Path, config: ml_collections.ConfigDict,
                  cells: Sequence[Cell]) -> None:
  """Makes `directory` a sweep of `config` over `cells`: refuses one that holds a sweep
  of other base settings (`check_manifest`), else writes its sweep.json."""
  directory.mkdir(parents=True, exist_ok=True)
  record = manifest(config, cells)
  check_manifest(directory, record)
  cli.write_files(directory, {MANIFEST: json.dumps(record, indent=2)})


def workers() -> int:
  """`--sweep_workers`, or 1 where flags were never parsed (a notebook, a test)."""
  return WORKERS.value if flags.FLAGS.is_parsed() else 1


def run_cells(cells: Sequence[Cell], directory: pathlib.Path, *, show_progress: bool = True,
              keep_runs: bool = False, num_workers: int | None = None) -> list[dict[str, Any]]:
  """Runs the cells not done yet, `num_workers` at a time (default `--sweep_workers`;
  see the module docstring), appending a row to results.jsonl as each ends; returns the
  rows of every cell (done before or now), in grid order."""
  num_workers = workers() if num_workers is None else num_workers
  if num_workers < 1:
    raise ValueError(f"--sweep_workers must be >= 1, got {num_workers}")
  done = {row["cell_id"]: row for row in read_rows(directory)}
  todo = [cell for cell in cells if cell.cell_id not in done]

  def record(cell: Cell, summary: dict[str, Any], files: dict[str, str]) -> None:
    row = dict(cell_id=cell.cell_id, cell=cell.values, metrics=flatten(summary),
               summary=summary, premises=summary["premises"])
    if keep_runs:
      run_directory = directory / "runs" / cell.cell_id
      run_directory.mkdir(parents=True, exist_ok=True)
      cli.write_files(run_directory, files)
    cli.append_line(directory / RESULTS, json.dumps(row))  # whole, or not at all
    done[cell.cell_id] = row
    cli.write_files(directory, {TABLE: tidy_table([done[c.cell_id] for c in cells
                                                   if c.cell_id in done])})

  with progress.Bars(enabled=show_progress) as bars:
    grid = bars.add(f"sweep {len(cells) - len(todo)}/{len(cells)} done", len(todo))
    if num_workers == 1 or len(todo) < 2:
      for number, cell in enumerate(todo):
        grid.update(number, cell.describe())
        record(cell, *serve_bench.run_bench(cell.config, bars=bars))
    else:
      context = multiprocessing.get_context("spawn")
      with concurrent.futures.ProcessPoolExecutor(min(num_workers, len(todo)),
                                                  mp_context=context) as pool:
        def on_done(number: int, cell: Cell, result: tuple[dict[str, Any], dict[str, str]]):
          record(cell, *result)
          grid.update(number + 1, cell.describe())
        run_in_pool(pool, todo, functools.partial(_run_cell, keep_runs=keep_runs), on_done)
    grid.update(len(todo), "done")
  rows = [done[cell.cell_id] for cell in cells]
  cli.write_files(directory, {TABLE: tidy_table(rows)})
  return rows


def run_in_pool(pool: concurrent.futures.Executor, cells: Sequence[Cell],
                run: Callable[[ml_collections.ConfigDict], Any],
                on_done: Callable[[int, Cell, Any], None]) -> None:
  """Submits `run(cell.config)` for every cell and hands each result to `on_done` in the
  order the cells end. The first cell that raises (or an interrupt) ends it: the cells
  not started are cancelled, those running are waited for and dropped, the error raised."""
  running = {pool.submit(run, cell.config): cell for cell in cells}
  try:
    for number, future in enumerate(concurrent.futures.as_completed(running)):
      on_done(number, running.pop(future), future.result())
  except BaseException:
    pool.shutdown(wait=True, cancel_futures=True)
    raise


def _run_cell(config: ml_collections.ConfigDict,
              keep_runs: bool) -> tuple[dict[str, Any], dict[str, str]]:
  """One cell in a worker process (`run_cells`): its summary, and its files if they are
  kept (a run's trace and step records run to megabytes: a study's thousands of cells
  would pile up in the parent)."""
  summary, files = serve_bench.run_bench(config, show_progress=False)
  return summary, files if keep_runs else {}


def default_x(axes: Sequence[Axis]) -> str:
  """The load axis of the curves: arrival_rate if swept, else the first numeric key."""
  keys = [axis.key for axis in axes]
  if "arrival_rate" in keys:
    return "arrival_rate"
  for axis in axes:
    try:
      [float(value) for value in axis.values]
      return axis.key
    except (TypeError, ValueError):
      continue
  raise ValueError("--plot needs a numeric swept key for the x axis (e.g. "
                   "--sweep=arrival_rate=1,2,4); none of the swept keys is numeric")


def axes_from_flags(config: ml_collections.ConfigDict) -> list[Axis]:
  if not _SWEEP.value:
    raise ValueError("no --sweep=KEY=V1,V2,... given: nothing to sweep")
  return [parse_axis(text, config) for text in _SWEEP.value]


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = serve_bench.config_from_flags()
  axes = axes_from_flags(config)
  if not 1 <= _SEEDS.value <= MAX_SEEDS:
    raise ValueError(f"--seeds must be in [1, {MAX_SEEDS:,}], got {_SEEDS.value:,}")
  if config.bench.seed + _SEEDS.value > 2**32:
    raise ValueError(f"--seed {config.bench.seed} + --seeds {_SEEDS.value} passes 2**32")
  seeds = [config.bench.seed + i for i in range(_SEEDS.value)]
  cells = plan(config, axes, seeds)
  x = _PLOT_X.value or (default_x(axes) if flags.FLAGS.plot else None)
  if flags.FLAGS.plot:
    from experiments import plots  # fails now, not after the runs, without matplotlib
    if x not in [axis.key for axis in axes]:
      raise ValueError(f"--plot_x={x!r} is not a swept key ({[axis.key for axis in axes]})")
  with cli.workdir(flags.FLAGS.workdir) as directory:
    cli.enable_compilation_cache(flags.FLAGS.compilation_cache)
    rows = run_sweep(config, cells, directory, keep_runs=_KEEP_RUNS.value)
    if flags.FLAGS.plot:
      plots.save(plots.sweep_curves(rows, x=x, metrics=DEFAULT_CURVES, title="kvpage sweep"),
                 directory / CURVES)
  print(format_table(rows))
  print(f"\nwrote {directory}/{RESULTS}, {TABLE}, {MANIFEST}"
        f"{', ' + CURVES if flags.FLAGS.plot else ''}")


def _figure(value: Any, scale: float = 1.0, digits: int = 1) -> str:
  return "n/a" if value is None else f"{scale * value:,.{digits}f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """The printed table: swept values, then throughput, the mean running batch (`batch`,
  sequences per step weighted by time; n/a for rows run before it was recorded),
  latencies, rejections and preemptions."""
  keys = list(dict.fromkeys(key for row in rows for key in row["cell"]))
  names = [key.split(".")[-1] for key in keys]
  header = [*names, "tok/s", "batch", "TTFT p99 ms", "TPOT p99 ms", "stall ms", "rejected",
            "preempt"]
  lines = ["  ".join(f"{name:>11}" for name in header)]
  for row in rows:
    m = row["metrics"]
    cells = [str(row["cell"][key]) for key in keys] + [
        _figure(m["output_tokens_per_s"], digits=0), _figure(m.get("running_batch_mean")),
        _figure(m["ttft_p99_s"], 1e3),
        _figure(m["tpot_p99_s"], 1e3), _figure(m["max_stall_s"], 1e3),
        str(m["num_rejected"]), str(m["num_preemptions"])]
    lines.append("  ".join(f"{cell:>11}" for cell in cells))
  return "\n".join(lines)


if __name__ == "__main__":
  cli.run(main)
