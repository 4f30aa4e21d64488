"""Servers and load clients in processes of their own, on cores of their own: the
helpers the HTTP benchmarks share (`http_overhead`, `fleet_http`). Flag-free."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from benchmarks.load_client import LoadConfig


def over_http(load: LoadConfig, cores: set[int] | None) -> dict:
  """The same workload from the load client, in a process of its own on `cores`;
  figures at the client."""
  with tempfile.TemporaryDirectory() as directory:
    output = pathlib.Path(directory) / "load.json"
    settings = {field.name: getattr(load, field.name) for field in dataclasses.fields(load)}
    argv = [f"--{name}={value}" for name, value in settings.items() if value is not None
            and not isinstance(value, bool)]
    argv += [f"--{'' if value else 'no'}{name}" for name, value in settings.items()
             if isinstance(value, bool)]
    subprocess.run([sys.executable, "-m", "benchmarks.serve_http", *argv, f"--output={output}"],
                   check=True, stdout=subprocess.DEVNULL, preexec_fn=_pinned(cores))
    summary = json.loads(output.read_text())["summary"]
  return dict(served=summary["served"], rejections=summary["rejections"],
              ttft_s={k: summary["ttft_s"][k] for k in ("p50", "p99")},
              itl_s={k: summary["itl_s"][k] for k in ("p50", "p99")})


def _pinned(cores: set[int] | None):
  """A `preexec_fn` that confines the child to `cores` (None: leave it be)."""
  return None if cores is None else lambda: os.sched_setaffinity(0, cores)


def core_split(pin: bool = True) -> tuple[set[int] | None, set[int] | None]:
  """(engine cores, client cores): the load client on a core of its own, so that on a
  small machine its parsing does not slow the engine's steps in one run and not the
  other (a co-located client costs a 2-core machine's steps ~40%); None if not possible
  or not `pin`."""
  if not pin or not hasattr(os, "sched_getaffinity"):
    return None, None
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < 2:
    return None, None
  return set(cores[:-1]), {cores[-1]}


def start_server(command: list[str], cores: set[int] | None) -> tuple[subprocess.Popen, str]:
  """Starts `python -m <command>` on `cores`; the process and the URL it printed."""
  process = subprocess.Popen([sys.executable, "-m", *command], stdout=subprocess.PIPE,
                             text=True, preexec_fn=_pinned(cores))
  for line in process.stdout:
    found = re.search(r" on (http://127\.0\.0\.1:\d+) ", line)
    if found:
      return process, found.group(1)
  raise RuntimeError(f"{command[0]} exited with {process.wait()} before listening")
