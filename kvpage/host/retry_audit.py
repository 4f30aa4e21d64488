"""Were the retry hints honest? An audit of recent rejections, at every step's end.

A client refused with "come back in h seconds" was told the truth if a retry at h is
admitted and h was not much longer than it had to wait. The server never sees whether
a client retries, but it can ask, at the end of every step (nothing changes between
steps), whether the same request arriving now would be admitted:
`Scheduler.would_admit`, every line of `add_request`, without side effects. The first
such moment after the refusal (or the admission of a retry under the same request id,
if sooner) is the wait that was actually needed; `hint / needed`
says whether the hint ran early (under 1: a client that honours it is refused again)
or late (over 1: it idles while the server has room).

Needed waits are measured at step boundaries, so a wait shorter than a step reads as
one step; and a refusal is asked again only once `RESOLUTION` of its hint has passed
since it was last asked, so a needed wait reads at most that share of the hint late
(a 30 s hint is asked every 0.3 s, not at each of a thousand steps: under a storm the
audit watches hundreds of refusals, and asking each at every step cost the server
more time than its steps). A refusal still inadmissible `HORIZON` x its hint later
ends unresolved (`needed_s` None: its hint was more than that many times too short).
At most `capacity` refusals are open at once; later ones are counted (`skipped`), not
audited, so the audit's cost per step stays bounded under a storm.

Pure Python: never imports jax.
"""

import collections
import dataclasses
from collections.abc import Callable

from kvpage.interface import Admission
from kvpage.request import Request

HORIZON = 4.0  # a refusal is watched until this many times its hint (at least MIN_WATCH_S)
MIN_WATCH_S = 1.0
RESOLUTION = 0.01  # a refusal is asked again once this share of its hint has passed


@dataclasses.dataclass(frozen=True)
class Audited:
  """One refusal's verdict: its reason, the hint it was given, and the wait it needed
  (None: still refused when the watch ended, `watched_s` after the refusal)."""

  reason: str
  hint_s: float
  needed_s: float | None
  watched_s: float

  @property
  def ratio(self) -> float:
    """hint / needed (for an unresolved refusal, an upper bound: hint / watched)."""
    return self.hint_s / max(self.needed_s or self.watched_s, 1e-9)


@dataclasses.dataclass
class _Open:
  request: Request
  reason: str
  hint_s: float
  refused_at: float
  asked_at: float  # when it was last asked


class RetryAudit:
  """Watches up to `capacity` refused requests until a retry would be admitted."""

  def __init__(self, capacity: int):
    if capacity < 1:
      raise ValueError(f"the audit's capacity must be at least 1, got {capacity}")
    self.capacity = capacity
    self.skipped = 0  # refusals not audited: `capacity` were open already
    self._open: list[_Open] = []
    self._done: collections.deque[Audited] = collections.deque()

  def note(self, request: Request, answer: Admission, now: float) -> None:
    """A refusal with a retry hint (429 or 503) to watch; others are ignored."""
    if answer.retry_after is None or answer.admitted:
      return
    if len(self._open) >= self.capacity:
      self.skipped += 1
      return
    self._open.append(_Open(request, answer.cause, answer.retry_after, now, now))

  def probe(self, now: float, would_admit: Callable[[Request], bool]) -> None:
    """At a step's end: each open refusal that would now be admitted, or whose watch
    is over, gets its verdict."""
    still = []
    for entry in self._open:
      waited = now - entry.refused_at
      if now - entry.asked_at < RESOLUTION * entry.hint_s:
        still.append(entry)
        continue
      entry.asked_at = now
      if waited > 0 and would_admit(entry.request):
        self._done.append(Audited(entry.reason, entry.hint_s, waited, waited))
      elif waited > max(HORIZON * entry.hint_s, MIN_WATCH_S):
        self._done.append(Audited(entry.reason, entry.hint_s, None, waited))
      else:
        still.append(entry)
    self._open = still

  def admitted(self, request_id: str, now: float) -> None:
    """A request was admitted: a refusal open under its id (a retry that kept its id)
    needed no longer than it waited."""
    for entry in [e for e in self._open if e.request.request_id == request_id]:
      waited = now - entry.refused_at
      self._done.append(Audited(entry.reason, entry.hint_s, waited, waited))
      self._open.remove(entry)

  @property
  def num_open(self) -> int:
    return len(self._open)

  def take(self) -> list[Audited]:
    """The verdicts reached since the last call (each is handed out once)."""
    done = list(self._done)
    self._done.clear()
    return done
