"""What every kvpage entry point shares: one-line errors instead of tracebacks.

Bad input (an unknown flag value, a config file that does not load, a premise that
does not hold) ends the program with `error: <what is wrong>` on stderr and exit
status 1 — never a traceback. Entry points call `run(main)` instead of `app.run`.
"""

import pathlib
import sys
import tempfile
from collections.abc import Callable

from absl import app, flags


def _last_line(error: BaseException) -> str:
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  last = lines[-1] if lines else type(error).__name__
  return last.removeprefix("ValueError: ")


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    sys.exit(f"error: {_last_line(error)}")


def load_config(holder: flags.FlagHolder):
  """The value of a `config_flags.DEFINE_config_file` flag, or a one-line exit."""
  try:
    config = holder.value
    config.keys()  # A config that failed to load raises on first attribute access.
    return config
  except (OSError, ValueError, AttributeError, KeyError) as error:
    sys.exit(f"error: cannot load --{holder.name}: {_last_line(error)}")


def prepare_workdir(path: str) -> pathlib.Path:
  """Creates `path` and checks it is writable, so a run never ends unable to save."""
  workdir = pathlib.Path(path)
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=workdir):
      pass
  except OSError as error:
    raise ValueError(f"--workdir {path!r} is not a writable directory: {error}") from None
  return workdir


def enable_compilation_cache(directory: str | None) -> None:
  """Keeps compiled XLA programs on disk, so a second run skips compilation."""
  if directory:
    import jax  # Imported here: entry points without jax (capacity) stay jax-free.

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def run(main: Callable[[list[str]], None]) -> None:
  """`app.run(main)`, with flag errors and `ValueError`s reported in one line."""

  def guarded_main(argv: list[str]) -> None:
    if len(argv) > 1:
      sys.exit(f"error: unexpected arguments {argv[1:]}; all options are --flags")
    try:
      main(argv)
    except ValueError as error:
      sys.exit(f"error: {error}")
    except OSError as error:  # a file that is missing or cannot be written
      sys.exit(f"error: {error}")

  app.run(guarded_main, flags_parser=_parse_flags)
