"""One persistent XLA compilation cache for the whole test run.

Most tests build the same tiny model and compile the same step programs (serve_bench
runs, servers, engines, the multi-step and preemption checks), many of them in
subprocesses. The controller makes one fresh cache directory and exports it in jax's
own environment variables before the xdist workers start, so every worker and every
subprocess they launch compiles a program once per run and loads it after. A fresh
directory per run: a cold start every time, as on CI. A JAX_COMPILATION_CACHE_DIR set
by the caller is kept.
"""

import os
import pathlib
import shutil
import tempfile

import pytest

_CREATED: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
  if hasattr(config, "workerinput") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return  # a worker (it inherited the controller's), or the caller chose one
  directory = tempfile.mkdtemp(prefix="kvpage-test-xla-cache-")
  _CREATED.append(directory)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


def pytest_unconfigure(config: pytest.Config) -> None:
  del config
  for directory in _CREATED:
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
  """The run's compilation cache, for server processes' `--compilation_cache`."""
  shared = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  return pathlib.Path(shared) if shared else tmp_path_factory.mktemp("jax_cache")


def _worker(entry: str):
  from cli_harness import Worker  # (tests/ is on the path when conftest runs)

  worker = Worker(entry)
  yield worker
  worker.close()


@pytest.fixture(scope="module")
def serve_bench():
  """`experiments.serve_bench`'s `main`, run in one worker process per test module."""
  yield from _worker("serve_bench")


@pytest.fixture(scope="module")
def sweep_worker():
  """`experiments.sweep`'s `main`, run in one worker process per test module."""
  yield from _worker("sweep")
