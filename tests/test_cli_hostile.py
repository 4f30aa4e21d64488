"""The command lines as a careless operator meets them: config files that do not run,
flags that contradict each other, inputs without end, signals mid-run, files that
cannot be written. Each ends in one `error:` line, exit 2, and nothing half-written;
a run's recorded premises are what it ran.

In-process through `cli_harness.Worker` where it can; subprocesses for what only a
real process shows (signals, a missing module, a port already taken).
"""

import errno
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
from cli_harness import ROOT, Worker, assert_one_error_line

from experiments import cli

SIM = ["--config=configs/tiny.py", "--executor=sim", "--num_requests=4"]


CONFIG_FILES = {
    "syntax": (b"def get_config(:\n", "SyntaxError: invalid syntax, line 1"),
    "import": (b"import no_such_module_here\n", "ModuleNotFoundError"),
    "raises": (b"def get_config():\n  return 1 / 0\n", "ZeroDivisionError: division by zero"),
    "binary": (bytes(range(256)) * 4, "SyntaxError"),
    "utf16": ("def get_config():\n  return None\n".encode("utf-16"), "SyntaxError"),
    "none": (b"def get_config():\n  return None\n", "get_config() returned None"),
    "dict": (b"def get_config():\n  return {'model': 1}\n",
             "get_config() must return an ml_collections.ConfigDict, got dict"),
}


@pytest.mark.parametrize("name", list(CONFIG_FILES))
def test_a_config_file_that_does_not_run_is_one_line(serve_bench, tmp_path, name):
  content, message = CONFIG_FILES[name]
  config = tmp_path / f"{name}.py"
  config.write_bytes(content)
  argv = [f"--config={config}", "--executor=sim", f"--workdir={tmp_path}/run"]
  rc, stderr = serve_bench.run(argv)
  assert_one_error_line(rc, stderr, argv)
  assert rc == 2 and message in stderr, stderr
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--trace=TRACE", "--prompt_len=999"], "--trace replaces --prompt_len"),
    (["--trace=TRACE", "--arrival_rate=1", "--num_requests=3"],
     "--trace replaces --arrival_rate, --num_requests"),
    (["--trace=TRACE", "--config.bench.output_len=7"], "--trace replaces --output_len"),
    (["--lengths_csv=TRACE", "--prompt_len=5"], "--lengths_csv replaces --prompt_len"),
    (["--watermark=0.1", "--config.scheduler.watermark=0.5"],
     "--watermark=0.1 and --config.scheduler.watermark=0.5 disagree"),
    (["--num_pages=64", "--config.cache.num_pages=128"],
     "--num_pages=64 and --config.cache.num_pages=128 disagree"),
    (["--config=configs/llama_13b.py"], "--config is given 2 times"),
    (["--workdir="], "--workdir is empty"),
    (["--trace=/dev/zero"], "not a regular file"),
    (["--calibration=/dev/zero"], "not a regular file"),
])
def test_flags_that_cannot_apply_together_or_read_without_end_are_refused(
    serve_bench, tmp_path, flags, message):
  trace = tmp_path / "trace.jsonl"
  trace.write_text(json.dumps(dict(request_id="a", arrival_time=0.0, prompt_ids=[1, 2],
                                   output_len=3)) + "\n")
  argv = [*SIM[:2], f"--workdir={tmp_path}/run",
          *[flag.replace("TRACE", str(trace)) for flag in flags]]
  if "--num_requests=3" not in flags and not any(f.startswith("--trace") for f in flags):
    argv.append("--num_requests=4")
  rc, stderr = serve_bench.run(argv)
  assert_one_error_line(rc, stderr, argv)
  assert message in stderr, stderr
  assert not (tmp_path / "run").exists()


def test_a_shortcut_and_its_config_path_may_agree(tmp_path):
  argv = [*SIM, "--watermark=0.25", "--config.scheduler.watermark=0.25",
          f"--workdir={tmp_path}/run"]
  worker = Worker("serve_bench")  # its own: an override flag is defined once per process
  try:
    rc, stderr = worker.run(argv)
  finally:
    worker.close()
  assert rc == 0, stderr
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["premises"]["policies"]["watermark"] == 0.25


def test_a_traced_run_records_the_trace_not_the_synthetic_defaults(serve_bench, tmp_path):
  trace = tmp_path / "trace.jsonl"
  trace.write_text("".join(json.dumps(dict(request_id=f"r{i}", arrival_time=0.1 * i,
                                           prompt_ids=[1] * (5 + i), output_len=3)) + "\n"
                           for i in range(3)))
  argv = [*SIM[:2], f"--trace={trace}", f"--workdir={tmp_path}/run"]
  rc, stderr = serve_bench.run(argv)
  assert rc == 0, stderr
  run = json.loads((tmp_path / "run" / "summary.json").read_text())["premises"]["workload"]
  assert run["trace"] == str(trace)
  assert run["prompt_len"] == run["arrival_rate"] == "trace"
  assert "shared_prefix" not in run and "priority" not in run
  assert run["observed"]["num_requests"] == 3


def test_a_result_that_cannot_be_written_leaves_nothing_behind(serve_bench, tmp_path):
  workdir = tmp_path / "run"
  (workdir / "trace.jsonl").mkdir(parents=True)  # in the way of one of the four files
  argv = [*SIM, f"--workdir={workdir}"]
  rc, stderr = serve_bench.run(argv)
  assert_one_error_line(rc, stderr, argv)
  assert "trace.jsonl" in stderr
  assert sorted(path.name for path in workdir.iterdir()) == ["trace.jsonl"]


def test_sweep_seeds_are_bounded_before_a_grid_is_planned(sweep_worker, tmp_path):
  argv = [*SIM, "--sweep=arrival_rate=1,2", "--seeds=1000000000", f"--workdir={tmp_path}/s"]
  rc, stderr = sweep_worker.run(argv)
  assert_one_error_line(rc, stderr, argv)
  assert "--seeds must be in [1, 1,000]" in stderr


def test_a_row_cut_short_is_dropped_on_resume_and_said(sweep_worker, tmp_path):
  directory = tmp_path / "s"
  argv = [*SIM, "--sweep=arrival_rate=1,2", f"--workdir={directory}"]
  rc, stderr = sweep_worker.run(argv)
  assert rc == 0, stderr
  results = directory / "results.jsonl"
  rows = results.read_text().splitlines()
  results.write_text(rows[0] + "\n" + rows[1][: len(rows[1]) // 2])  # a crash mid-write
  rc, stderr = sweep_worker.run(argv)
  assert rc == 0 and "results.jsonl:2 is a row cut short" in stderr, stderr
  assert [json.loads(line)["cell_id"] for line in results.read_text().splitlines()] == [
      json.loads(line)["cell_id"] for line in rows]


def test_an_append_that_fails_leaves_the_file_as_it_was(tmp_path, monkeypatch):
  path = tmp_path / "results.jsonl"
  cli.append_line(path, '{"a": 1}')

  def full_disk(descriptor: int) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(os, "fsync", full_disk)
  with pytest.raises(OSError, match="No space left"):
    cli.append_line(path, '{"b": 2}')
  assert path.read_text() == '{"a": 1}\n'


def test_capacity_refuses_a_prefix_longer_than_the_request(tmp_path):
  worker = Worker("capacity")
  try:
    argv = ["--config=configs/llama_13b.py", "--seq_len=100", "--shared_prefix=1000:2"]
    rc, stderr = worker.run(argv)
  finally:
    worker.close()
  assert_one_error_line(rc, stderr, argv)
  assert "must be shorter than --seq_len=100" in stderr


# Real processes.
def _run(module: str, *flags: str, env: dict | None = None,
         timeout_s: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, text=True,
                        capture_output=True, timeout=timeout_s, env=env)


def test_plot_without_matplotlib_is_one_line(tmp_path):
  blocker = tmp_path / "sitecustomize.py"  # an install without the notebooks extra
  blocker.write_text("import sys\nsys.modules['matplotlib'] = None\n")
  env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  done = _run("experiments.serve_bench", *SIM, "--plot", f"--workdir={tmp_path}/run", env=env)
  assert_one_error_line(done.returncode, done.stderr, ["--plot"])
  assert done.returncode == 2 and "figures need matplotlib" in done.stderr
  assert not (tmp_path / "run").exists()


def test_serve_checks_its_address_before_warming_up():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    done = _run("experiments.serve", "--executor=sim", f"--port={port}")
  assert_one_error_line(done.returncode, done.stderr, ["serve"])
  assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
  assert "compiled" not in done.stdout  # refused before any warm-up
  done = _run("experiments.serve", "--executor=sim", "--host=no-such-host.invalid")
  assert_one_error_line(done.returncode, done.stderr, ["serve"])
  assert "the host does not resolve" in done.stderr


def wait_until_caught(pid: int, sig: signal.Signals, timeout_s: float = 60.0) -> None:
  """Until process `pid` catches `sig` (its handler installed: Linux's /proc); before
  that the signal's default action ends it, which no program can report."""
  status = pathlib.Path(f"/proc/{pid}/status")
  deadline = time.monotonic() + timeout_s
  while status.exists() and time.monotonic() < deadline:
    caught = next((line.split()[1] for line in status.read_text().splitlines()
                   if line.startswith("SigCgt:")), "0")
    if int(caught, 16) >> (sig - 1) & 1:
      return
    time.sleep(0.005)


@pytest.mark.parametrize(("sig", "after_s", "executor"), [
    (signal.SIGTERM, 0.0, "sim"),  # still importing: as soon as the handler is in
    (signal.SIGTERM, 5.0, "sim"),  # mid-run
    (signal.SIGINT, 5.0, "jax"),  # mid-compile: once ended in a segmentation fault
])
def test_a_signal_mid_run_ends_in_one_line_and_leaves_no_workdir(tmp_path, sig, after_s,
                                                                  executor):
  workdir = tmp_path / "run"
  process = subprocess.Popen(
      [sys.executable, "-m", "experiments.serve_bench", "--config=configs/tiny.py",
       f"--executor={executor}", "--num_requests=100000", "--arrival_rate=inf",
       "--compilation_cache=", f"--workdir={workdir}"],
      cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      env={**os.environ, "JAX_COMPILATION_CACHE_DIR": ""})
  wait_until_caught(process.pid, sig)  # (a loaded machine starts Python slowly)
  time.sleep(after_s)
  process.send_signal(sig)
  _, stderr = process.communicate(timeout=120)
  assert_one_error_line(process.returncode, stderr, [sig.name])
  assert process.returncode == 2 and "error: interrupted" in stderr
  assert not workdir.exists()


def test_write_files_is_all_or_nothing(tmp_path):
  (tmp_path / "b.json").mkdir()
  with pytest.raises(OSError, match=r"b\.json"):
    cli.write_files(tmp_path, {"a.json": "1", "b.json": "2"})
  assert sorted(path.name for path in tmp_path.iterdir()) == ["b.json"]
  cli.write_files(tmp_path / "b.json", {"a.json": "1"})
  assert (tmp_path / "b.json" / "a.json").read_text() == "1"
  assert [path.name for path in (tmp_path / "b.json").iterdir()] == ["a.json"]
  assert pathlib.Path(tmp_path / "b.json" / "a.json").is_file()
