"""Runs an entry point's `main` in-process, many times, in one worker process.

absl flags are global and the three entry points define flags of the same names, so
each entry point gets its own worker: `python tests/cli_harness.py serve_bench` reads
one JSON argv list per line on stdin and answers one JSON line per run on stdout:
`{"rc": exit status, "stderr": what the run wrote to stderr, "hang": bool}`. Tests
talk to it through `Worker`, which costs one interpreter start per entry point
instead of one per example.
"""

import contextlib
import importlib
import io
import json
import os
import pathlib
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Hang(BaseException):
  """Raised by the alarm; a BaseException, so no `except Exception` in kvpage hides it."""


def _serve(entry: str, time_limit_s: int) -> None:
  from experiments import cli

  module = importlib.import_module(f"experiments.{entry}")

  timed_out = [False]

  def alarm(*_):
    timed_out[0] = True  # remembered: a callback that swallows the exception hides it
    raise Hang

  signal.signal(signal.SIGALRM, alarm)
  for line in sys.stdin:
    argv = json.loads(line)
    err, timed_out[0], rc = io.StringIO(), False, -1
    signal.alarm(time_limit_s)
    try:
      with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli.invoke(module.main, [entry, *argv])
    except Hang:
      pass
    finally:
      signal.alarm(0)
    print(json.dumps(dict(rc=rc, stderr=err.getvalue(), hang=timed_out[0])), flush=True)


class Worker:
  """A worker process for one entry point; `run(argv)` -> (exit status, stderr)."""

  def __init__(self, entry: str, time_limit_s: int = 60, cache_dir: str | None = None):
    self.env = dict(os.environ)
    if cache_dir:  # runs that compile the same programs load them instead
      self.env.update(JAX_COMPILATION_CACHE_DIR=cache_dir,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    self.command = [sys.executable, str(pathlib.Path(__file__)), entry, str(time_limit_s)]
    self._start()

  def _start(self) -> None:
    self.process = subprocess.Popen(self.command, cwd=ROOT, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env=self.env)

  def run(self, argv: list[str]) -> tuple[int, str]:
    assert self.process.stdin and self.process.stdout
    try:
      self.process.stdin.write(json.dumps(argv) + "\n")
      self.process.stdin.flush()
      answer = self.process.stdout.readline()
    except BrokenPipeError:
      answer = ""
    if not answer:  # killed (by the kernel's OOM killer, say): a fresh one for the next
      status = self.process.wait(timeout=60)
      self._start()
      raise AssertionError(f"the worker died (status {status}) running {argv}")
    result = json.loads(answer)
    assert not result["hang"], f"hang: {argv}"
    return result["rc"], result["stderr"]

  def close(self) -> None:
    if self.process.stdin:
      with contextlib.suppress(BrokenPipeError):
        self.process.stdin.close()
    self.process.wait(timeout=60)


def assert_one_error_line(rc: int, stderr: str, argv: list[str], *, internal_ok: bool = False):
  """A failed run printed exactly one line, `error: ...`, and it is not a kvpage defect."""
  lines = [line for line in stderr.splitlines() if line.strip()]
  assert rc != 0, (argv, stderr)
  assert len(lines) == 1 and lines[0].startswith("error: "), (argv, stderr)
  assert internal_ok or "internal error" not in lines[0], (argv, lines[0])


if __name__ == "__main__":
  sys.path.insert(0, str(ROOT))
  _serve(sys.argv[1], int(sys.argv[2]))
