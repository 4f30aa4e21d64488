"""Progress bars for long runs: rich's, on stderr, drawn only when stderr is a terminal.

`Bars` is one live display holding any number of bars, so a sweep shows its grid and
the run in progress at once (rich allows one live display at a time):

  with progress.Bars() as bars:
    bar = bars.add("serve_bench[sim]", total=400)
    bar.update(120, "kv 63%")
"""

import time
import types
from collections.abc import Callable

from rich import console as rich_console
from rich import progress as rich_progress


class Bar:
  """One bar of a `Bars` display."""

  def __init__(self, display: rich_progress.Progress, task: rich_progress.TaskID):
    self._display, self._task = display, task

  def update(self, done: int, note: str = "", label: str | None = None) -> None:
    """`done` of the total so far, with a short note (and a new label, if given)."""
    changes = {} if label is None else {"description": label}
    self._display.update(self._task, completed=done, note=note, **changes)

  def remove(self) -> None:
    self._display.remove_task(self._task)


class Bars:
  """A live display of bars on stderr; a no-op when disabled or not on a terminal."""

  def __init__(self, enabled: bool = True):
    console = rich_console.Console(stderr=True)
    self.enabled = enabled and console.is_terminal
    self._display = rich_progress.Progress(
        rich_progress.TextColumn("{task.description}"), rich_progress.BarColumn(),
        rich_progress.MofNCompleteColumn(), rich_progress.TimeElapsedColumn(),
        rich_progress.TextColumn("{task.fields[note]}"),
        console=console, disable=not self.enabled, refresh_per_second=5)

  def add(self, label: str, total: int) -> Bar:
    return Bar(self._display, self._display.add_task(label, total=max(total, 1), note=""))

  def __enter__(self) -> "Bars":
    self._display.start()
    return self

  def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
               trace: types.TracebackType | None) -> None:
    self._display.stop()


def lines(say: Callable[[str], None], what: str, every_s: float = 2.0,
          clock: Callable[[], float] = time.monotonic) -> Callable[[int, int], None]:
  """A `progress(done, total)` that says `what done/total` in plain lines, for any
  stream (a log file, a pipe, a container's output): at the first, then at most every
  `every_s` seconds, and at the last."""
  last = [-float("inf")]

  def report(done: int, total: int) -> None:
    now = clock()
    if done in (1, total) or now - last[0] >= every_s:
      last[0] = now
      say(f"{what} {done}/{total}")

  return report
