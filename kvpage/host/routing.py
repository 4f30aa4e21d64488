"""Which replica of a fleet takes a request: the routing policies, in one place.

A fleet is many engines behind one door. The door asks a `Router` to rank the
replicas for each request and tries them in that order: the first that admits it
serves it, and only when every replica refuses does the client get pushed back. The
router decides from each replica's `ReplicaStats`, a snapshot refreshed every so often
(`Router.update`), and between snapshots counts what it has sent itself (`Router.sent`),
so a burst does not all land on the replica that looked emptiest.

The policies:

  * `round_robin`: each in turn;
  * `least_requests`: the power of two choices (Ray Serve's default): two replicas
    drawn at random, the one with fewer requests (running, waiting, sent since the
    snapshot) first;
  * `kv_headroom`: the replica whose pool keeps the most room above its KV line after
    this request's estimated pages (free pages above the watermark, less the pages
    promised to its waiting requests and to what the router sent since);
  * `prefix_affinity`: the replica holding the longest cached prefix of the prompt
    (full pages, named by `kvpage.host.prefix_cache`'s chain hashes), unless it has
    less headroom than the best by more than `headroom_margin_pages` or a longer wait
    than the best by more than `wait_margin_s`: then `kv_headroom`.

Every ranking holds every replica: a refusal at the first is retried at the next.
`route` is the fleet's door: it tries the replicas in rank order and admits the request
at the first that takes it; a 400 that no replica can cure (`REQUEST_FAULTS`) is
answered at once;
only when every replica pushes back does the client get a 429/503, with the soonest
replica's retry hint (its status when all refused for one kind of reason, else 503).

Pure Python, no jax and no Ray: the same code ranks replicas in a simulated fleet and
behind a Ray Serve request router.
"""

import dataclasses
import itertools
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvpage.host import prefix_cache
from kvpage.interface import BAD_REQUEST, SERVICE_UNAVAILABLE, Admission
from kvpage.units import cdiv

if TYPE_CHECKING:
  from kvpage.host.scheduler import Scheduler

POLICIES = ("round_robin", "least_requests", "kv_headroom", "prefix_affinity")
# prefix_affinity's default margins in a fleet (serve --replicas, serve_bench): the
# replica holding the longest prefix may have up to 256 pages less headroom (4,096
# tokens of 16) and a forecast wait up to 1 s longer than the best replica.
HEADROOM_MARGIN_PAGES = 256
WAIT_MARGIN_S = 1.0
# 400s that are the request's own fault on every replica of a fleet serving one model
# (others, such as a prompt too big for one replica's pool, send it on to the next).
REQUEST_FAULTS = ("empty_prompt", "invalid_token_ids", "context_length_exceeded")
# Refusals a replica gives only after its KV line admitted the request (the KV line
# answers first, `kvpage.host.admission.AdmissionControl.decide`, then the scheduler's
# forecast lines): a replica refusing for one of these had KV room for the request.
AFTER_KV_LINE = ("token_budget", "concurrency_limit", "queue_full", "wait_forecast",
                 "wait_deadline")


@dataclasses.dataclass(frozen=True)
class ReplicaStats:
  """What a replica reports for routing (a snapshot)."""

  replica_id: str
  num_running: int = 0
  num_waiting: int = 0
  # Free pages above its KV line: free pages less the watermark's and less what running
  # prompts still take (may be negative: it refuses until requests end).
  headroom_pages: int = 0
  promised_pages: int = 0  # page estimates of admitted requests not yet running
  wait_s: float = 0.0  # its forecast wait for a newcomer's first token
  page_size: int = 16
  prefix_pages: frozenset[bytes] = frozenset()  # chain hashes of its cached full pages
  taken_at: float = 0.0  # when, on the replica's clock: a fresh snapshot differs from the last


@dataclasses.dataclass(frozen=True)
class RouteRequest:
  """What the router needs of a request: its size and its prompt's page hashes."""

  num_prompt_tokens: int
  max_tokens: int
  page_hashes: tuple[bytes, ...] = ()  # its prompt's full pages, in order (`prompt_hashes`)

  def pages(self, page_size: int) -> int:
    """The pages its prompt and `max_tokens` take (the admission line's estimate)."""
    return cdiv(self.num_prompt_tokens + self.max_tokens, page_size)


def replica_stats(replica_id: str, scheduler: "Scheduler") -> ReplicaStats:
  """A replica's snapshot, read from its scheduler: headroom above its KV line (free
  pages, less the watermark's, less what running prompts still take), its admitted
  backlog, the forecast wait of the last request in its queue (0 when none waits), its
  prefix cache's page names, and the time on its clock."""
  pool, admission = scheduler.page_pool, scheduler.admission
  headroom = (pool.num_free_pages - admission.watermark_pages
              - admission.owed_pages(scheduler.running))
  wait = (scheduler.eta(scheduler.waiting[-1].request_id, first_token=True) or 0.0
          if scheduler.waiting else 0.0)
  return ReplicaStats(
      replica_id, num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
      headroom_pages=int(headroom), promised_pages=admission.num_backlog_pages, wait_s=wait,
      page_size=pool.page_size,
      prefix_pages=pool.prefix.names() if pool.prefix is not None else frozenset(),
      taken_at=scheduler.clock())


def prompt_hashes(prompt_ids: Sequence[int], page_size: int) -> tuple[bytes, ...]:
  """The chain hashes of a prompt's full pages, as a replica's prefix cache names them
  (the last token left out: a replica computes it whatever it holds)."""
  hashes: list[bytes] = []
  for start in range(0, len(prompt_ids) - 1 - page_size + 1, page_size):
    hashes.append(prefix_cache.page_hash(hashes[-1] if hashes else None,
                                         prompt_ids[start:start + page_size]))
  return tuple(hashes)


def cached_prefix_pages(stats: ReplicaStats, request: RouteRequest) -> int:
  """How many of the prompt's leading full pages `stats`' replica holds."""
  count = 0
  for page in request.page_hashes:
    if page not in stats.prefix_pages:
      break
    count += 1
  return count


class Router:
  """Ranks a fleet's replicas for each request by one of `POLICIES`."""

  def __init__(self, policy: str, *, seed: int = 0, headroom_margin_pages: int = 0,
               wait_margin_s: float = 0.0):
    if policy not in POLICIES:
      raise ValueError(f"unknown routing policy {policy!r}; choose one of "
                       f"{', '.join(POLICIES)}")
    if headroom_margin_pages < 0 or wait_margin_s < 0:
      raise ValueError("the prefix-affinity margins must be >= 0")
    self.policy = policy
    self.headroom_margin_pages = headroom_margin_pages
    self.wait_margin_s = wait_margin_s
    self._rng = random.Random(seed)
    self._turn = itertools.count()
    self._stats: dict[str, ReplicaStats] = {}
    self._sent_requests: dict[str, int] = {}
    self._sent_pages: dict[str, int] = {}

  @property
  def replicas(self) -> list[str]:
    return list(self._stats)

  def update(self, stats: Sequence[ReplicaStats]) -> None:
    """The fleet's replicas, each with its latest snapshot. A replica whose snapshot is
    new counts afresh what it is sent (what was sent before is in the snapshot now); one
    whose snapshot is the one it had keeps its count; one missing has left the fleet."""
    if not stats:
      raise ValueError("a fleet needs at least one replica")
    old = self._stats
    self._stats = {s.replica_id: s for s in stats}
    for name, snapshot in self._stats.items():
      if old.get(name) != snapshot:
        self._sent_requests[name] = self._sent_pages[name] = 0
    for name in [name for name in self._sent_requests if name not in self._stats]:
      del self._sent_requests[name], self._sent_pages[name]

  def sent(self, replica_id: str, request: RouteRequest) -> None:
    """`request` was admitted by `replica_id`: counted until the next snapshot."""
    self._sent_requests[replica_id] += 1
    self._sent_pages[replica_id] += request.pages(self._stats[replica_id].page_size)

  def requests(self, replica_id: str) -> int:
    """Its requests as the router sees them: running, waiting, sent since the snapshot."""
    stats = self._stats[replica_id]
    return stats.num_running + stats.num_waiting + self._sent_requests[replica_id]

  def headroom(self, replica_id: str, request: RouteRequest) -> int:
    """Pages above its line left after its promises, what was sent since the snapshot,
    and `request`."""
    stats = self._stats[replica_id]
    return (stats.headroom_pages - stats.promised_pages - self._sent_pages[replica_id]
            - request.pages(stats.page_size))

  def rank(self, request: RouteRequest) -> list[str]:
    """Every replica, the one to try first first."""
    if not self._stats:
      raise ValueError("no replica stats yet: call update() first")
    names = list(self._stats)
    if self.policy == "round_robin":
      start = next(self._turn) % len(names)
      return names[start:] + names[:start]
    if self.policy == "least_requests":
      pair = self._rng.sample(names, min(2, len(names)))
      pair.sort(key=self.requests)
      rest = sorted((n for n in names if n not in pair), key=self.requests)
      return pair + rest
    by_headroom = sorted(names, key=lambda n: (-self.headroom(n, request),
                                               self._stats[n].wait_s))
    if self.policy == "kv_headroom":
      return by_headroom
    return self._prefix_first(request, by_headroom)

  def _prefix_first(self, request: RouteRequest, by_headroom: list[str]) -> list[str]:
    """`prefix_affinity`: the replica with the longest cached prefix first, if it is
    within the margins of the best headroom and wait; then by headroom."""
    hits = {name: cached_prefix_pages(self._stats[name], request) for name in by_headroom}
    most = max(hits.values())
    if most == 0:
      return by_headroom
    best_room = self.headroom(by_headroom[0], request)
    best_wait = min(s.wait_s for s in self._stats.values())
    for name in sorted(by_headroom, key=lambda n: -hits[n]):  # stable: headroom breaks ties
      if hits[name] < most:
        break
      if (self.headroom(name, request) >= best_room - self.headroom_margin_pages
          and self._stats[name].wait_s <= best_wait + self.wait_margin_s):
        return [name] + [n for n in by_headroom if n != name]
    return by_headroom


@dataclasses.dataclass(frozen=True)
class Routed:
  """Where a request went: the replica that admitted it (None: every one refused), the
  answer the client gets, and the replicas tried, in order, with their answers."""

  replica_id: str | None
  answer: Admission
  tried: tuple[tuple[str, Admission], ...]


class Door:
  """One request at the fleet's door: the replicas' answers as they come (`answer`),
  and the outcome once one admits it, or it is the request's own fault, or every replica
  was asked (`refused`). Each replica is asked at most once; at most one admits."""

  def __init__(self) -> None:
    self.tried: list[tuple[str, Admission]] = []

  def asked(self, replica_id: str) -> bool:
    return any(name == replica_id for name, _ in self.tried)

  def answer(self, replica_id: str, answer: Admission) -> Routed | None:
    """`replica_id`'s answer; the outcome if it ends the request's round, else None
    (ask the next)."""
    if self.asked(replica_id):
      raise ValueError(f"replica {replica_id} was asked twice for one request")
    self.tried.append((replica_id, answer))
    if answer.admitted:
      return Routed(replica_id, answer, tuple(self.tried))
    if answer.status == BAD_REQUEST and answer.cause in REQUEST_FAULTS:
      return Routed(None, answer, tuple(self.tried))  # no replica can serve it: no retry
    return None

  def refused(self) -> Routed:
    """Every replica asked refused: the fleet's answer."""
    if not self.tried:
      raise ValueError("no replica was asked")
    return Routed(None, _fleet_refusal([answer for _, answer in self.tried]),
                  tuple(self.tried))


def route(router: Router, request: RouteRequest,
          admit: Callable[[str], Admission]) -> Routed:
  """The fleet's door: `admit(replica_id)` asks one replica to take the request (its
  admission answer); replicas are asked in `router.rank` order until one admits, and
  the router counts what it sent. A request is asked of each replica at most once and
  admitted by at most one."""
  door = Door()
  for replica_id in router.rank(request):
    routed = door.answer(replica_id, admit(replica_id))
    if routed is not None:
      if routed.replica_id is not None:
        router.sent(replica_id, request)
      return routed
  return door.refused()


def _fleet_refusal(answers: Sequence[Admission]) -> Admission:
  """Every replica refused: the soonest retry hint among them (None if none gave one);
  their status if they agree, else 503 (the fleet is short of room somewhere)."""
  hints = [a.retry_after for a in answers if a.retry_after is not None]
  soonest = min(answers, key=lambda a: (a.retry_after is None, a.retry_after or 0.0))
  statuses = {a.status for a in answers}
  status = statuses.pop() if len(statuses) == 1 else SERVICE_UNAVAILABLE
  return Admission(status, f"every replica refused ({len(answers)}); the soonest: "
                   f"{soonest.reason}", min(hints) if hints else None,
                   soonest.request_id, soonest.cause)
