"""`experiments/sweep.py`: a grid of serve_bench runs, resumable, checked up front; and
the figures of `experiments/plots.py`."""

import concurrent.futures
import csv
import dataclasses
import json
import subprocess
import sys
import threading

import ml_collections
import pytest
from cli_harness import ROOT, assert_one_error_line

from experiments import serve_bench, sweep

# The simulated 13B: deterministic (virtual time), and a few ms of host work per run.
BASE = ["--executor=sim", "--config=configs/llama_13b.py", "--hardware=a100_80gb",
        "--num_requests=24", "--prompt_len=mix:0.2:1500:100", "--output_len=uniform:8:48",
        "--seed=3"]


def rows_of(directory) -> list[dict]:
  return [json.loads(line) for line in (directory / "results.jsonl").read_text().splitlines()]


def test_a_cell_equals_a_standalone_serve_bench_run(sweep_worker, tmp_path):
  rc, stderr = sweep_worker.run([*BASE, "--sweep=chunk_size=256,1024", "--sweep=arrival_rate=6",
                                 f"--workdir={tmp_path}/sweep"])
  assert rc == 0, stderr
  standalone = subprocess.run(
      [sys.executable, "-m", "experiments.serve_bench", *BASE, "--chunk_size=256",
       "--arrival_rate=6", f"--workdir={tmp_path}/alone"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert standalone.returncode == 0, standalone.stderr
  alone = json.loads((tmp_path / "alone" / "summary.json").read_text())
  rows = {row["cell"]["scheduler.chunk_size"]: row for row in rows_of(tmp_path / "sweep")}
  assert set(rows) == {256, 1024}
  assert rows[256]["summary"] == alone  # every figure and every premise
  assert rows[256]["metrics"] == sweep.flatten(alone)
  assert rows[1024]["summary"]["premises"]["policies"]["chunk_size"] == 1024
  assert rows[1024]["summary"] != alone


def test_a_sweep_resumes_skipping_done_cells(sweep_worker, tmp_path):
  argv = [*BASE, "--sweep=watermark=0.05,0.3", "--seeds=2", f"--workdir={tmp_path}"]
  assert sweep_worker.run(argv) == (0, "")
  first = rows_of(tmp_path)
  assert [(r["cell"]["scheduler.watermark"], r["cell"]["seed"]) for r in first] == [
      (0.05, 3), (0.05, 4), (0.3, 3), (0.3, 4)]
  assert sweep_worker.run(argv)[0] == 0
  assert rows_of(tmp_path) == first  # nothing ran again
  # A crash mid-row: the cut line is dropped and its cell runs again.
  text = (tmp_path / "results.jsonl").read_text()
  (tmp_path / "results.jsonl").write_text(text[:len(text) - 40])
  wider = [*BASE, "--sweep=watermark=0.05,0.3,0.15", "--seeds=2", f"--workdir={tmp_path}"]
  assert sweep_worker.run(wider)[0] == 0
  rows = rows_of(tmp_path)
  assert rows[:3] == first[:3] and len(rows) == 6
  assert {r["cell"]["scheduler.watermark"] for r in rows[3:]} == {0.3, 0.15}
  with open(tmp_path / "results.csv") as f:
    table = list(csv.DictReader(f))
  assert len(table) == 6 and {"scheduler.watermark", "seed", "ttft_p99_s"} <= set(table[0])
  # Other base settings would mix two experiments in one table: refused.
  rc, stderr = sweep_worker.run([*wider, "--num_requests=30"])
  assert rc == 2 and "holds a sweep of another base config" in stderr
  assert "num_requests" in stderr


def test_workers_run_the_same_rows_as_one_process(sweep_worker, tmp_path):
  """Two spawned workers: every row as the serial sweep wrote it (the simulator is
  deterministic), appended as each cell ends; a resumed sweep runs nothing again."""
  argv = [*BASE, "--sweep=watermark=0.05,0.3", "--seeds=2"]
  assert sweep_worker.run([*argv, f"--workdir={tmp_path}/one"]) == (0, "")
  assert sweep_worker.run([*argv, "--sweep_workers=2", f"--workdir={tmp_path}/two"]) == (0, "")
  serial = {row["cell_id"]: row for row in rows_of(tmp_path / "one")}
  parallel = {row["cell_id"]: row for row in rows_of(tmp_path / "two")}
  assert parallel == serial and len(parallel) == 4
  assert sweep_worker.run([*argv, "--sweep_workers=2", f"--workdir={tmp_path}/two"]) == (0, "")
  assert len(rows_of(tmp_path / "two")) == 4
  rc, stderr = sweep_worker.run([*argv, "--sweep_workers=0", f"--workdir={tmp_path}/zero"])
  assert rc != 0 and "--sweep_workers must be >= 1" in stderr


def test_a_cell_failing_in_a_worker_stops_the_sweep_with_its_error(tmp_path):
  from configs import llama_13b
  config = llama_13b.get_config()
  config.bench.update(dict(executor="sim", num_requests=8, prompt_len="mix:0.2:1500:100",
                           output_len="uniform:8:16"))
  config.hardware = "a100_80gb"
  bad = config.copy_and_resolve_references()
  bad.bench.prompt_len = "zipf:3"  # past the grid check: fails when its run starts
  cells = [sweep.Cell({"scheduler.watermark": w, "seed": 0}, bad if w == 0.2 else config)
           for w in (0.1, 0.2, 0.3, 0.4)]
  with pytest.raises(ValueError, match="zipf"):
    sweep.run_cells(cells, tmp_path, show_progress=False, num_workers=2)
  rows = rows_of(tmp_path) if (tmp_path / sweep.RESULTS).exists() else []
  assert {row["cell"]["scheduler.watermark"] for row in rows} <= {0.1, 0.3, 0.4}
  # Which good cells end before the failure is seen depends on how fast each worker
  # process starts; that nothing queued behind the failure runs is checked below.


def test_the_pool_runs_no_cell_after_one_fails():
  started, release = [], threading.Event()

  def run(config):
    started.append(config.name)
    if config.name == "bad":
      raise ValueError("bad cell")
    release.wait(timeout=60)  # the good cell in the other thread is still running
    return config.name

  cells = [sweep.Cell({"i": i}, ml_collections.ConfigDict(dict(name=name)))
           for i, name in enumerate(["good", "bad"] + ["later"] * 6)]
  done = []
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    threading.Timer(0.5, release.set).start()
    with pytest.raises(ValueError, match="bad cell"):
      sweep.run_in_pool(pool, cells, run, lambda number, cell, result: done.append(result))
  # The thread that ran the bad cell may take one more before the cancel; no more.
  assert started[:2] in (["good", "bad"], ["bad", "good"]) and len(started) <= 3
  assert done == []  # the failure is seen before the good cell ends: nothing recorded


@pytest.mark.parametrize("flags,message", [
    ([], "nothing to sweep"),
    (["--sweep=chunk_size"], "must be KEY=V1,V2"),
    (["--sweep=chunk_size="], "empty"),
    (["--sweep=chunk_size=256,,512"], "empty item"),
    (["--sweep=chunk_size=256,256"], "repeat"),
    (["--sweep=chunk_sise=256"], "no serve_bench flag and no config key"),
    (["--sweep=scheduler.nope=1"], "the config has no 'nope'"),
    (["--sweep=scheduler=1"], "a config section"),
    (["--sweep=chunk_size=big"], "'big' is not int"),
    (["--sweep=executor=gpu"], "--sweep executor"),
    (["--sweep=num_requests=ten"], "--sweep num_requests"),
    (["--sweep=seed=1,2"], "use --seeds"),
    (["--sweep=chunk_size=1", "--sweep=scheduler.chunk_size=2"], "names a key twice"),
    (["--sweep=chunk_size=256", "--seeds=0"], "--seeds must be in [1, 1,000]"),
    # A cell no run could take, caught before the first run starts.
    (["--sweep=prefill_policy=chunked,none"], "the cell prefill_policy=none seed=3 cannot run"),
    (["--sweep=watermark=0.1,1.5"], "watermark must be a fraction"),
    (["--sweep=arrival_rate=2,fast"], "is not a number or inf"),
    (["--sweep=chunk_size=256", "--plot", "--plot_x=seed"], "--plot_x='seed' is not a swept"),
])
def test_bad_grids_are_one_line_before_any_run(sweep_worker, tmp_path, flags, message):
  argv = [*BASE, *flags, f"--workdir={tmp_path}/sweep"]
  rc, stderr = sweep_worker.run(argv)
  assert_one_error_line(rc, stderr, argv)
  assert rc == 2 and message in stderr, stderr
  assert not (tmp_path / "sweep").exists()


def test_bench_settings_mirror_the_flags_and_the_config():
  # Each setting is a `bench` entry of the config, a flag that writes it and a
  # `BenchSettings` field: the three must not drift apart.
  from absl import flags

  from configs import tiny

  section = tiny.get_config().bench
  assert sorted(section.keys()) == sorted(serve_bench.SETTINGS)
  for field in dataclasses.fields(serve_bench.BenchSettings):
    assert flags.FLAGS[field.name].default == field.default == section[field.name], field.name
  assert serve_bench.BenchSettings.from_config(tiny.get_config()) == serve_bench.BenchSettings()


def test_the_summary_measures_kv_waste_of_the_run(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.serve_bench", *BASE, "--arrival_rate=4",
       f"--workdir={tmp_path}", "--plot"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  summary = json.loads((tmp_path / "summary.json").read_text())
  rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
  lengths = [r["prompt_tokens"] + r["output_tokens"] for r in rows
             if r["finish_reason"] in ("length", "stop")]
  waste = summary["kv_waste"]
  page = summary["premises"]["page_size"]
  assert waste["used_tokens"] == sum(lengths) and waste["max_len"] == 4096
  assert waste["paged_reserved_tokens"] == sum(-(-n // page) * page for n in lengths)
  assert waste["contiguous_reserved_tokens"] == 4096 * len(lengths)
  assert 0 < waste["paged_waste"] < 1 / 3 < waste["contiguous_waste"] < 1
  assert "KV waste" in result.stdout
  batch = summary["running_batch"]
  assert 0 < batch["mean"] <= batch["p99"] and "running batch" in result.stdout
  assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_the_tables_carry_the_mean_running_batch():
  """results.csv has the running batch's figures and the printed table its mean; a row
  resumed from before it was recorded reads n/a (an empty cell in the CSV)."""
  summary = dict(num_requests=2, num_finished=2, num_rejected=0, rejections={},
                 num_preemptions=0, max_kv_usage=0.5, duration_s=1.0,
                 output_tokens_per_s=100.0, prompt_tokens_per_s=200.0,
                 goodput_requests_per_s=2.0, goodput_fraction=1.0,
                 prefill_tokens_computed=10, recomputed_tokens=0,
                 running_batch=dict(mean=3.5, p50=4.0, p99=4.0),
                 **{key: dict(p50=0.01, p99=0.02, max=0.03)
                    for key in ("queue_wait_s", "ttft_s", "tpot_s", "itl_s", "e2e_s")})
  metrics = sweep.flatten(summary)
  assert (metrics["running_batch_mean"], metrics["running_batch_p50"],
          metrics["running_batch_p99"]) == (3.5, 4.0, 4.0)
  old = {name: value for name, value in metrics.items() if not name.startswith("running")}
  rows = [dict(cell_id="a", cell={"arrival_rate": 1.0}, metrics=metrics),
          dict(cell_id="b", cell={"arrival_rate": 2.0}, metrics=old)]
  table = list(csv.DictReader(sweep.tidy_table(rows).splitlines()))
  assert [row["running_batch_mean"] for row in table] == ["3.5", ""]
  header, new, resumed = sweep.format_table(rows).splitlines()
  column = header.split().index("batch")
  assert new.split()[column] == "3.5" and resumed.split()[column] == "n/a"


def test_sweep_curves_draw_one_line_per_policy(tmp_path):
  plots = pytest.importorskip("experiments.plots")
  premises = dict(model=dict(name="m"), dtype="fp16", hardware=dict(name="h"),
                  policies=dict(chunk_size=256), workload={}, packages={})
  rows = [dict(cell={"scheduler.chunk_size": chunk, "arrival_rate": rate, "seed": seed},
               metrics={"ttft_p99_s": rate * chunk / 1e3 + seed, "num_rejected": None},
               premises=premises)
          for chunk in (256, 512) for rate in (1.0, 2.0, 4.0) for seed in (0, 1)]
  fig = plots.sweep_curves(rows, x="arrival_rate", metrics=["ttft_p99_s", "num_rejected"])
  lines = fig.axes[0].get_legend_handles_labels()[1]
  assert lines == ["chunk_size=256", "chunk_size=512"]
  # The mean over seeds 0 and 1, in milliseconds.
  assert fig.axes[0].lines[0].get_ydata().tolist() == pytest.approx(
      [1e3 * (r * 0.256 + 0.5) for r in (1.0, 2.0, 4.0)])
  assert "chunk=swept" in fig.get_suptitle() and "seed swept" in fig.get_suptitle()
  assert plots.save(fig, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
