"""What every kvpage entry point shares: one line per error, and whole workdirs or none.

Bad input (an unknown flag value, a config file that does not load, a premise that
does not hold, a pool that does not fit in memory) ends the program with exactly one
line, `error: <what is wrong>`, on stderr and exit status 2 — never a traceback. A
defect of kvpage itself is not the user's fault and must not pass for it: it also
ends in one line, naming itself an internal error and the file that holds the
traceback, with exit status 1. Entry points call `run(main)` instead of `app.run`;
tests call `invoke(main, argv)` to run one in-process.

A run's output files are written under temporary names and renamed into place only
when all of them are written (`write_files`), and `workdir` removes the directories
it created if the run fails, so a failed run leaves nothing behind.
"""

import contextlib
import dataclasses
import gc
import logging
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from absl import app, flags

USAGE_ERROR, INTERNAL_ERROR = 2, 1

# jax logs at INFO each accelerator backend it probes and cannot find ("Unable to
# initialize backend 'tpu'"); absl prints INFO, which would make a one-line error two.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
# config_flags warns before the error `load_config` reports in one line.
logging.getLogger("absl").addFilter(
    lambda record: "did you forget a return statement" not in str(record.msg))


class UsageError(ValueError):
  """Bad input, already phrased for the user: the message is the whole error line."""


def _last_line(error: BaseException) -> str:
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  last = lines[-1] if lines else type(error).__name__
  last = last.removeprefix("ValueError: ")
  while len(last) > 1 and last[0] == last[-1] and last[0] in "\"'":  # KeyError's quoting
    last = last[1:-1]
  return last


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with every failure (config overrides and config files
  included) as one line."""
  given = [arg for arg in argv[1:] if arg.split("=")[0] in ("--config", "-config")]
  if len(given) > 1:
    raise UsageError(f"--config is given {len(given)} times ({', '.join(given)}): give one")
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    raise UsageError(_last_line(error)) from None
  except (AttributeError, KeyError, TypeError, ValueError) as error:
    # A `--config.a.b=...` override names a key the config lacks or a value of the
    # wrong type; ml_collections reports it as a chain of these.
    if isinstance(error, UnicodeDecodeError) or not _overrides(argv):
      raise UsageError(_config_file_error(error, given)) from None
    raise UsageError(_override_error(error, argv)) from None
  except Exception as error:  # the config file's own code failed: its error, one line
    raise UsageError(_config_file_error(error, given)) from None


def _config_file_error(error: BaseException, given: list[str]) -> str:
  """One line for a config file that does not run: its error, and where."""
  where = f"the config file {given[0].split('=', 1)[-1]!r}" if given else "the config file"
  if isinstance(error, SyntaxError):
    at = f", line {error.lineno}" if error.lineno else ""
    return f"cannot load {where}: SyntaxError: {error.msg}{at}"
  return f"cannot load {where}: {type(error).__name__}: {_last_line(error)}"


def config_overrides() -> dict[str, str]:
  """The `--config.PATH=VALUE` overrides on this program's command line, by path."""
  return _overrides(sys.argv)


def _overrides(argv: list[str]) -> dict[str, str]:
  """The `--config.PATH=VALUE` overrides in `argv`, by path."""
  found = {}
  for arg in argv[1:]:
    name, equals, value = arg.lstrip("-").partition("=")
    if name.startswith("config.") and equals:
      found[name.removeprefix("config.")] = value
  return found


def check_one_source(config: Any, shortcuts: dict[str, tuple[str, Any]]) -> None:
  """Raises `UsageError` where a shortcut flag (name -> (config path, value)) and a
  `--config.PATH=...` override of the same path were both given, with different values:
  the run would silently use one of them."""
  overridden = config_overrides()
  for name, (path, value) in shortcuts.items():
    if path not in overridden:
      continue
    *sections, key = path.split(".")
    node = config
    for section in sections:
      node = node[section]
    if node[key] != value:
      raise UsageError(f"--{name}={value} and --config.{path}={overridden[path]} disagree: "
                       "give one of them")


def _override_error(error: BaseException, argv: list[str]) -> str:
  """One line for a `--config.KEY=VALUE` override that `config_flags` refused."""
  override = next((a.split("=")[0] for a in argv if a.lstrip("-").startswith("config.")), None)
  if override is None:
    return f"bad flags: {_last_line(error)}"
  if isinstance(error, (AttributeError, KeyError)):
    key = _last_line(error)
    return f"bad config override {override}: the config has no key {key!r}"
  return f"bad config override {override}: {_last_line(error)}"


def load_config(holder: flags.FlagHolder):
  """The value of a `config_flags.DEFINE_config_file` flag, or a one-line exit."""
  import ml_collections  # Here: only entry points need it.

  try:
    config = holder.value
    config.keys()  # A config that failed to load raises on first attribute access.
  except (OSError, ValueError, AttributeError, KeyError, TypeError, SyntaxError,
          flags.Error) as error:
    if "Unexpected None value" in str(error):  # config_flags' word for it
      raise UsageError(f"cannot load --{holder.name}: get_config() returned None") from None
    raise UsageError(f"cannot load --{holder.name}: {_last_line(error)}") from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise UsageError(f"cannot load --{holder.name}: get_config() must return an "
                     f"ml_collections.ConfigDict, got {type(config).__name__}")
  return config


def _missing_parents(path: pathlib.Path) -> list[pathlib.Path]:
  """`path` and those of its ancestors that do not exist yet, deepest first."""
  missing = []
  for directory in (path, *path.parents):
    if directory.exists():
      break
    missing.append(directory)
  return missing


@contextlib.contextmanager
def workdir(path: str) -> Iterator[pathlib.Path]:
  """Creates `path`, checks it is writable, and removes what it created if the body fails.

  Checked up front so that a run never ends unable to save its results; removed on
  failure so that a rejected input leaves no empty directory behind.
  """
  if not path.strip():
    raise UsageError("--workdir is empty: name the directory the run writes into")
  directory = pathlib.Path(path)
  created = _missing_parents(directory.absolute())
  try:
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory):
      pass
  except OSError as error:
    _remove_empty(created)
    raise UsageError(f"--workdir {path!r} is not a writable directory: {error}") from None
  try:
    yield directory
  except BaseException:
    _remove_empty(created)
    raise


def _remove_empty(directories: list[pathlib.Path]) -> None:
  for directory in directories:  # deepest first; one that holds anything stays
    with contextlib.suppress(OSError):
      directory.rmdir()


def write_files(directory: pathlib.Path, files: dict[str, str]) -> None:
  """Writes every `name -> text` into `directory`, all or nothing.

  The files are written into a temporary folder inside `directory` (so each final
  rename stays on one file system and is atomic), and every destination is checked to
  be replaceable; only then are they renamed into place. If anything fails, the
  temporary folder is removed and `directory` holds what it held before.
  """
  staging = pathlib.Path(tempfile.mkdtemp(dir=directory, prefix=".staging-"))
  try:
    for name, text in files.items():
      (staging / name).write_text(text)
    for name in files:
      target = directory / name
      if target.is_dir() or (target.exists() and not os.access(target, os.W_OK)):
        raise OSError(f"cannot write {target}: it is a directory or read-only")
    for name in files:
      os.replace(staging / name, directory / name)
  finally:
    shutil.rmtree(staging, ignore_errors=True)


def append_line(path: pathlib.Path, line: str) -> None:
  """Appends `line` (one JSON row, no newline) to `path` whole: if the write fails (a
  full disk), the file is cut back to where it was, so no partial row stays."""
  with path.open("a") as f:
    start = f.tell()
    try:
      f.write(line + "\n")
      f.flush()
      os.fsync(f.fileno())
    except BaseException:
      with contextlib.suppress(OSError):
        f.truncate(start)
      raise


def enable_compilation_cache(directory: str | None) -> None:
  """Keeps compiled XLA programs on disk, so a second run skips compilation."""
  if directory:
    import jax  # Imported here: entry points without jax (capacity) stay jax-free.

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _report_internal(error: BaseException) -> str:
  """Saves the traceback of an unexpected exception; returns the one line that names it."""
  try:
    handle, path = tempfile.mkstemp(prefix="kvpage-traceback-", suffix=".txt")
    with os.fdopen(handle, "w") as f:
      traceback.print_exception(error, file=f)
    where = f"traceback in {path}"
  except OSError:
    where = "traceback could not be saved"
  summary = _last_line(error)[:200]
  return (f"error: internal error ({type(error).__name__}: {summary}); this is a kvpage "
          f"defect, not bad input — {where}")


def _guarded(main: Callable[[list[str]], None], argv: list[str]) -> int:
  """Runs `main`; returns the exit status after printing at most one `error:` line."""
  _RUNNING.append(True)
  try:
    if len(argv) > 1:
      raise UsageError(f"unexpected arguments {argv[1:]}; all options are --flags")
    main(argv)
    return 0
  except (ValueError, OSError) as error:  # bad input, a missing or unwritable file
    message = f"error: {error}"
  except MemoryError as error:  # numpy's allocation failure says how much it wanted
    message = f"error: out of memory: {_last_line(error) or 'an allocation failed'}"
  except KeyboardInterrupt:
    message = "error: interrupted; nothing half-written is left behind"
    _INTERRUPTED.append(True)
  except SystemExit:
    raise
  except Exception as error:  # a defect: reported as one, never passed off as bad input
    print(_report_internal(error), file=sys.stderr, flush=True)
    return INTERNAL_ERROR
  print(" ".join(message.split()), file=sys.stderr, flush=True)
  return USAGE_ERROR


def invoke(main: Callable[[list[str]], None], argv: list[str]) -> int:
  """Parses `argv` into the global flags afresh and runs `main`; returns the exit status.

  The in-process twin of `run`, for tests: no `app.run`, no `sys.exit`.
  `config_flags` reads its `--config.*` overrides from `sys.argv`, so it is set too;
  pass `--config` explicitly, or the config parsed at import is reused.
  """
  sys.argv = list(argv)
  flags.FLAGS.unparse_flags()
  try:
    remaining = _parse_flags(argv)
  except UsageError as error:
    print(f"error: {error}", file=sys.stderr, flush=True)
    return USAGE_ERROR
  return _guarded(main, remaining)


def define_config(default: str, help_string: str) -> flags.FlagHolder:
  """`config_flags.DEFINE_config_file("config", ...)`, with a bad override as one line.

  `config_flags` applies `--config.KEY=VALUE` overrides to the default config while
  the flag is being defined (at import, when no `--config` is given), before
  `run` can guard anything.
  """
  from ml_collections import config_flags  # Here: only entry points need it.

  try:
    return config_flags.DEFINE_config_file("config", default, help_string)
  except (AttributeError, KeyError, TypeError, ValueError, flags.Error) as error:
    print(f"error: {_override_error(error, sys.argv)}", file=sys.stderr, flush=True)
    sys.exit(USAGE_ERROR)


SCHEDULER_SHORTCUTS = ("prefill_policy", "chunk_size", "preemption_mode", "max_num_seqs",
                       "max_num_batched_tokens", "max_waiting", "watermark", "output_estimate",
                       "num_decode_steps", "admission")


def define_scheduler_shortcuts() -> dict[str, flags.FlagHolder]:
  """`--NAME` for `--config.scheduler.NAME`, for the knobs studies turn most."""
  return {name: flags.DEFINE_string(name, None, f"Shortcut for --config.scheduler.{name}.")
          for name in SCHEDULER_SHORTCUTS}


def apply_scheduler_shortcuts(config, holders: dict[str, flags.FlagHolder]) -> None:
  """The shortcut flags that were given, into `config.scheduler`, typed like the defaults."""
  typed = {}
  for name, holder in holders.items():
    if holder.value is not None:
      kind = type(config.scheduler[name])
      try:
        typed[name] = (f"scheduler.{name}", kind(holder.value))
      except ValueError:
        raise ValueError(f"--{name}={holder.value!r} must be of type {kind.__name__}") from None
  check_one_source(config, typed)
  for name, (_, value) in typed.items():
    config.scheduler[name] = value


def flag_or_override_given(*names: str) -> bool:
  """Whether the command line gave any of the flags `names` (a shortcut such as
  `watermark`, or a config override such as `config.scheduler.watermark`)."""
  return any(name in flags.FLAGS and flags.FLAGS[name].present for name in names)


def hold_serving_line(config: Any, watermark_given: bool = False) -> str:
  """The server's default lines into the scheduler section: its KV watermark
  (`server.watermark`) unless the command line set the scheduler's (`watermark_given`),
  and its forecast-TTFT line (`server.ttft_line_s`) unless the scheduler section holds
  one of its own; says which lines hold."""
  scheduler, line = config.scheduler, config.server.get("ttft_line_s")
  mark = config.server.get("watermark")
  if mark is not None and not watermark_given and scheduler.admission == "watermark":
    scheduler.watermark = float(mark)
    kv = f"KV watermark {mark:g} (server.watermark)"
  else:
    kv = (f"KV watermark {scheduler.watermark:g} (scheduler.watermark)"
          if scheduler.admission == "watermark" else "no KV line (admission queue_only)")
  if scheduler.max_forecast_ttft_s or scheduler.max_ttft_slowdown:
    return (f"{kv}; forecast TTFT line of the scheduler section: "
            + ", ".join(f"{name} {scheduler[name]:g}" for name in
                        ("max_forecast_ttft_s", "max_ttft_slowdown") if scheduler[name]))
  if not line:
    return f"{kv}; no forecast TTFT line (server.ttft_line_s unset)"
  scheduler.max_forecast_ttft_s = float(line)
  return f"{kv}; forecast TTFT line {line:g} s (server.ttft_line_s)"


def apply_retry_policy(config: Any) -> None:
  """The server's `retry_jitter`, `retry_audit` and `retry_reservations` into the
  scheduler section, unless it sets its own: clients refused in one burst are told
  different times, so they do not all come back at once, the server learns how long
  each really had to wait, and a client that returns when told finds its place."""
  jitter = config.server.get("retry_jitter")
  if jitter and not config.scheduler.retry_jitter:
    config.scheduler.retry_jitter = float(jitter)
  audit = config.server.get("retry_audit")
  if audit and not config.scheduler.get("retry_audit"):
    config.scheduler.retry_audit = int(audit)
  if config.server.get("retry_reservations"):
    config.scheduler.retry_reservations = True


def define_tensor_parallel() -> flags.FlagHolder:
  """`--tensor_parallel`, the shortcut for `--config.mesh.tensor_parallel`."""
  return flags.DEFINE_integer("tensor_parallel", None,
                              "Shortcut for --config.mesh.tensor_parallel: devices one step "
                              "runs on (weights and KV heads split over them).")


def load_config_with_mesh(config_holder: flags.FlagHolder,
                          tensor_parallel: flags.FlagHolder):
  """`load_config`, with `--tensor_parallel` applied when given."""
  config = load_config(config_holder)
  if tensor_parallel.value is not None:
    config.mesh.tensor_parallel = tensor_parallel.value
  return config


@dataclasses.dataclass(frozen=True)
class ProcessFlags:
  """`--coordinator_address`, `--num_processes`, `--process_id`: a multi-process run."""

  coordinator_address: flags.FlagHolder
  num_processes: flags.FlagHolder
  process_id: flags.FlagHolder


def define_processes() -> ProcessFlags:
  """The flags of a multi-process run (`kvpage.device.multihost`): one process per host."""
  return ProcessFlags(
      flags.DEFINE_string("coordinator_address", None,
                          "host:port of process 0's coordinator, for a multi-process run "
                          "(jax.distributed); every process gets the same value."),
      flags.DEFINE_integer("num_processes", 1, "Processes in the run (one per host)."),
      flags.DEFINE_integer("process_id", 0, "This process's index; 0 schedules."))


def initialize_processes(process_flags: ProcessFlags, executor: str = "jax") -> None:
  """Joins the multi-process run the flags describe (nothing for one process); call it
  before anything touches a device."""
  num_processes = process_flags.num_processes.value
  if num_processes < 1:
    raise ValueError(f"--num_processes must be >= 1, got {num_processes}")
  if num_processes == 1:
    return
  if executor != "jax":
    raise ValueError("--num_processes > 1 runs a real model (--executor=jax); the simulator "
                     "prices a multi-device step in one process (--tensor_parallel)")
  if not process_flags.coordinator_address.value:
    raise ValueError("--num_processes > 1 needs --coordinator_address=host:port")
  from kvpage.device import multihost  # Imports jax: only for a multi-process run.

  multihost.initialize(process_flags.coordinator_address.value, num_processes,
                       process_flags.process_id.value)


def run(main: Callable[[list[str]], None]) -> None:
  """`app.run(main)`, with every error reported in one line (see the module docstring)."""

  def flags_parser(argv: list[str]) -> list[str]:
    try:
      return _parse_flags(argv)
    except UsageError as error:
      print(f"error: {error}", file=sys.stderr, flush=True)
      sys.exit(USAGE_ERROR)

  catch_interrupts()
  app.run(lambda argv: _exit(_guarded(main, argv)), flags_parser=flags_parser)


_INTERRUPTED: list[bool] = []
_RUNNING: list[bool] = []  # whether `main` has started (before: imports, flags)


def _exit(status: int) -> None:
  """`sys.exit(status)`; after an interrupt, without the interpreter's teardown: XLA's
  compiler threads may still run, and tearing the runtime down under them crashes.
  Nothing is lost: the run unwound already (its workdir cleaned up, its files written
  whole or not at all)."""
  if _INTERRUPTED:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  sys.exit(status)


def catch_interrupts() -> None:
  """SIGINT and SIGTERM (what `timeout`, systemd and Kubernetes send) raise
  KeyboardInterrupt, which unwinds the run and ends it with one line, exit status 2."""
  signal.signal(signal.SIGINT, _interrupt)
  signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
  """Raises KeyboardInterrupt, unless `frame` is inside a garbage-collector callback
  (jax registers one), where Python would swallow it: then the signal is sent again
  in a moment, to land outside. Before `main` started (imports, flags), nothing can be
  half-written: the program ends at once, in one line."""
  if not _RUNNING:
    print("error: interrupted", file=sys.stderr, flush=True)
    os._exit(USAGE_ERROR)
  callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
  while frame is not None:
    if frame.f_code in callbacks:
      threading.Timer(0.05, signal.raise_signal, (signum,)).start()
      return
    frame = frame.f_back
  raise KeyboardInterrupt



def page_count_for_checkpoint(config: Any, checkpoint: str | None, num_pages_flag: str) -> None:
  """A config file's page count (`cache.num_pages`) sizes the config's own model: when a
  checkpoint replaces the model, the count gives way to the byte budget (bytes are
  model-independent, pages are not), unless the command line set it (the flag
  `num_pages_flag`, or `--config.cache.num_pages`)."""
  given = (flags.FLAGS[num_pages_flag].present
           or ("config.cache.num_pages" in flags.FLAGS
               and flags.FLAGS["config.cache.num_pages"].present))
  if checkpoint and not given and config.cache.num_pages:
    logging.info("cache.num_pages=%d sizes the config's own model; the checkpoint's pool "
                 "comes from the byte budget", config.cache.num_pages)
    config.cache.num_pages = 0


def load_checkpoint(config: Any, checkpoint: str) -> Any:
  """A Hugging Face Llama checkpoint's weights (returned) and model section, which
  replaces the config's but keeps its run choices (how attention and the products run
  is the config's choice, its hardware's, not the checkpoint's); the cache takes the
  checkpoint's precision."""
  from kvpage import sizing
  from kvpage.device import backends
  from models import hf

  model_config, params = hf.load(checkpoint)
  sizing.check_runnable(config, model_config)
  backends.RunChoices.of(config.model).write(model_config)
  config.model = model_config
  config.cache.kv_dtype = model_config.dtype
  return params


def serving_engine(config: Any, *, executor: str, hardware: Any, checkpoint: str | None = None,
                   **options: Any) -> Any:
  """`kvpage.build.serving_engine` for the experiments: the Llama model, its weights from
  `checkpoint` when given (`load_checkpoint`), and the calibration files shipped in
  `configs/calibrations/`."""
  from configs import hardware as hardware_lib
  from kvpage import build
  from models import llama

  params = load_checkpoint(config, checkpoint) if checkpoint else None
  return build.serving_engine(config, executor=executor, hardware=hardware, model=llama,
                              params=params, calibrations=hardware_lib.CALIBRATIONS, **options)


def backends_line(record: dict) -> str:
  """What computed the model's ops (`kvpage.device.backends.describe`), in one line."""
  native = record.get("native")
  native_text = "" if native is None else (
      f"; native library {native['variant']}" if native.get("status") == "ready"
      else f"; native library {native.get('status')}")
  return (f"attention {record['attention']}, products {record['linear']}, precision "
          f"{record['matmul_precision']} on {record['device']}{native_text}")
