"""A minimal progress bar on stderr for long runs (no dependency, redraws at most 5x/s)."""

import sys
import time


class Progress:
  """`Progress(total, label)`; call `update(done, note)`; `close()` ends the line."""

  def __init__(self, total: int, label: str, enabled: bool = True, width: int = 30):
    self.total, self.label, self.width = max(total, 1), label, width
    self.enabled = enabled and sys.stderr.isatty()
    self._last = 0.0

  def update(self, done: int, note: str = "") -> None:
    now = time.monotonic()
    if not self.enabled or (now - self._last < 0.2 and done < self.total):
      return
    self._last = now
    filled = int(self.width * done / self.total)
    bar = "#" * filled + "." * (self.width - filled)
    sys.stderr.write(f"\r{self.label} [{bar}] {done}/{self.total} {note}    ")
    sys.stderr.flush()

  def close(self) -> None:
    if self.enabled:
      sys.stderr.write("\n")
