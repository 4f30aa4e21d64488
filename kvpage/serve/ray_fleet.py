"""A fleet on Ray Serve: many engines behind one door, routed by their KV headroom.

Three pieces, each small; the routing policies themselves are `kvpage.host.routing`'s
(pure host code, shared with the simulated fleet), so a change of Ray's alpha
request-router API touches this adapter only.

  * `EngineReplica`, a Ray Serve deployment: one engine per replica process, built
    there by a picklable recipe (`ReplicaParts`), stepped by its own `EngineLoop`, with
    its own metrics. Its `serve` method is the fleet's admission call, streamed: the
    first item is the replica's answer (one engine's door: admitted, or refused with
    its reason and retry hint), the next items are batches of the request's deltas.
    Every `ROUTING_STATS_PERIOD_S` it reports routing stats (`record_routing_stats`):
    its headroom above the KV line, the pages promised to its waiting requests, its
    wait forecast, and its cached prefix pages (the first `PREFIX_HASH_BYTES` bytes of
    each page's chain hash: a compact summary, ample to tell pages apart).
  * `KvRequestRouter`, a Ray Serve `RequestRouter` in the ingress process: it ranks the
    candidate replicas with a `routing.Router` fed from those stats, leaving out the
    replicas this request already asked (its `exclude`), or sends a call to the one
    replica it names (`only`).
  * `FleetBackend` (`kvpage.serve.app.Backend`) and its `FleetLoop`: the gateway's
    engine side in the ingress process. For each request it runs the door
    (`routing.Door`): ask the best-ranked replica; on a refusal ask the next, never the
    same one twice, up to every live replica; only when all refuse does the client get
    the fleet's 429/503 with the soonest replica's retry hint. An admitted request's
    deltas are pumped from its replica into local `Stream`s, so the gateway's handlers
    (SSE, queueing comments, whole answers) are the single server's.

The ingress is the command's own process, serving kvpage's HTTP server
(`kvpage.serve.server`: its connection limits and its drain on SIGTERM), not a Ray
Serve HTTP proxy: the fleet's door keeps every promise the single server makes.

Faults. A replica process that dies ends the calls streaming from it: a request that
had no output yet is sent through the door again (the dead replica left out); one
that had output ends with an error event (`app.REPLICA_LOST`, a 503 `replica_lost`
with a short retry hint). Ray Serve restarts the replica; until it is back, `/health`
says "degraded" (200: the fleet still serves). A client that goes away cancels its
call, and the replica aborts what it still runs for it: its pages are free at once.
"""

import asyncio
import dataclasses
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import prometheus_client as prom
import ray
from prometheus_client import parser as prom_parser
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import RequestRouter

from kvpage.host import routing
from kvpage.host.engine import Engine
from kvpage.interface import SERVICE_UNAVAILABLE, Admission
from kvpage.serve.app import REPLICA_LOST
from kvpage.serve.engine_loop import Delta, EngineLoop, QueueStatus, Stream, Submission
from kvpage.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)

ROUTING_STATS_PERIOD_S = 0.2  # how often a replica's routing stats are refreshed
PREFIX_HASH_BYTES = 8  # of each cached page's 16-byte chain hash, in the routing stats
ANSWER_TIMEOUT_S = 60.0  # a replica that has not answered an admission call by then is
CALL_TIMEOUT_S = 10.0  # ... and status, metrics and state calls
LOST_RETRY_AFTER_S = 1.0  # the hint of a request whose replica died under it
REPEAT = "repeat"  # a replica asked again for a request it answered (every one was asked)
OUTCOMES = ("admitted_first", "admitted_retry", "refused", "request_fault", "no_replica")


@dataclasses.dataclass
class ReplicaParts:
  """What a replica's recipe builds, in the replica's process: an engine (warmed up),
  the tokenizer its deltas are detokenized with (None: token ids only), the model name."""

  engine: Engine
  tokenizer: Any
  model_name: str


# ---------------------------------------------------------------------------------------
# The router's view, shared by the request router and the door (both in the ingress).


class _View:
  """One fleet's routing state in the ingress process: the live replicas (Ray's
  `update_replicas`), the `routing.Router` that ranks them, and a lock (Ray's router
  runs on a thread of its own; the door on the server's event loop)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.router: routing.Router | None = None
    self.live: tuple[str, ...] = ()
    self._cache: dict[str, tuple[float, routing.ReplicaStats]] = {}

  def configure(self, policy: str, seed: int, headroom_margin_pages: int,
                wait_margin_s: float) -> None:
    with self.lock:
      if self.router is None or self.router.policy != policy:
        self.router = routing.Router(policy, seed=seed,
                                     headroom_margin_pages=headroom_margin_pages,
                                     wait_margin_s=wait_margin_s)

  def set_live(self, replica_ids: Sequence[str]) -> None:
    with self.lock:
      self.live = tuple(replica_ids)
      self._cache = {k: v for k, v in self._cache.items() if k in replica_ids}

  def stats(self, replica_id: str, reported: dict[str, Any] | None) -> routing.ReplicaStats:
    """`reported` (a replica's routing stats) as `ReplicaStats`, converted once per
    report."""
    reported = reported or {}
    taken_at = float(reported.get("taken_at", -1.0))
    cached = self._cache.get(replica_id)
    if cached is not None and cached[0] == taken_at:
      return cached[1]
    stats = routing.ReplicaStats(
        replica_id, num_running=int(reported.get("num_running", 0)),
        num_waiting=int(reported.get("num_waiting", 0)),
        headroom_pages=int(reported.get("headroom_pages", 0)),
        promised_pages=int(reported.get("promised_pages", 0)),
        wait_s=float(reported.get("wait_s", 0.0)),
        page_size=int(reported.get("page_size", 16)),
        prefix_pages=frozenset(reported.get("prefix_pages", ())), taken_at=taken_at)
    self._cache[replica_id] = (taken_at, stats)
    return stats

  def rank(self, stats: Sequence[routing.ReplicaStats],
           request: routing.RouteRequest) -> list[str]:
    with self.lock:
      assert self.router is not None, "the request router was not initialized"
      self.router.update(stats)
      return self.router.rank(request)

  def sent(self, replica_id: str, request: routing.RouteRequest) -> None:
    with self.lock:
      if self.router is not None and replica_id in self.router.replicas:
        self.router.sent(replica_id, request)


_VIEWS: dict[str, _View] = {}
_VIEWS_LOCK = threading.Lock()


def view(fleet: str) -> _View:
  """The routing view of the fleet (the Ray Serve application) named `fleet`."""
  with _VIEWS_LOCK:
    return _VIEWS.setdefault(fleet, _View())


def compact_hashes(hashes: Sequence[bytes]) -> tuple[bytes, ...]:
  """Page hashes as the routing stats carry them (`PREFIX_HASH_BYTES` each)."""
  return tuple(page[:PREFIX_HASH_BYTES] for page in hashes)


class KvRequestRouter(RequestRouter):
  """Ray Serve's request router, ranking by a `kvpage.host.routing` policy.

  Ray pickles this class by value into the process that routes, so module state is
  reached through an import inside the methods (the process's own `ray_fleet`)."""

  def initialize_state(self, fleet: str = "kvpage", policy: str = "kv_headroom",
                       seed: int = 0, headroom_margin_pages: int = 0,
                       wait_margin_s: float = 0.0) -> None:
    from kvpage.serve import ray_fleet

    self._fleet_view = ray_fleet.view(fleet)
    self._fleet_view.configure(policy, seed, headroom_margin_pages, wait_margin_s)

  def update_replicas(self, replicas: list[Any]) -> None:
    super().update_replicas(replicas)
    self._fleet_view.set_live([replica.replica_id.unique_id for replica in replicas])

  async def choose_replicas(self, candidate_replicas: list[Any],
                            pending_request: Any = None) -> list[list[Any]]:
    kwargs = pending_request.kwargs if pending_request is not None else {}
    by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
    only = kwargs.get("only")
    if only is not None:  # a call for one replica (a status, its metrics): it or any
      return [[by_id[only]]] if only in by_id else [candidate_replicas]
    request = kwargs.get("route")
    if not isinstance(request, routing.RouteRequest):  # not an admission call
      return [candidate_replicas]
    exclude = set(kwargs.get("exclude", ()))
    fresh = sorted(name for name in by_id if name not in exclude)  # (a stable order)
    if not fresh:  # every candidate was asked: one answers REPEAT, the door ends
      return [candidate_replicas]
    stats = [self._fleet_view.stats(name, by_id[name].routing_stats) for name in fresh]
    return [[by_id[name]] for name in self._fleet_view.rank(stats, request)]


# ---------------------------------------------------------------------------------------
# The replica.


class EngineReplica:
  """One engine of the fleet, in a Ray Serve replica process (`deployment` wraps it)."""

  def __init__(self, recipe: Callable[[], ReplicaParts]):
    self.replica_id = serve.get_replica_context().replica_id.unique_id
    parts = recipe()
    self.engine, self.tokenizer = parts.engine, parts.tokenizer
    self.metrics = ServerMetrics(self.engine.scheduler, self.engine.clock, parts.model_name)
    prom.Gauge("kvpage:replica_info", "Where this replica runs: its process and node.",
               ("pid", "node"), registry=self.metrics.registry).labels(
                   str(os.getpid()), ray.util.get_node_ip_address()).set(1)
    self._loop: EngineLoop | None = None

  def _engine_loop(self) -> EngineLoop:
    """The engine loop, started on the replica's event loop at its first call."""
    if self._loop is None:
      self._loop = EngineLoop(self.engine, asyncio.get_running_loop(), metrics=self.metrics,
                              tokenizer=self.tokenizer)
      self._loop.start()
    return self._loop

  def _not_me(self, only: str | None) -> bool:
    return only is not None and only != self.replica_id

  async def serve(self, submissions: Sequence[Submission], *,
                  route: routing.RouteRequest | None = None, exclude: Sequence[str] = (),
                  only: str | None = None) -> AsyncIterator[Any]:
    """Admits `submissions` (all or none); yields `(replica_id, Admission)` (or
    `(replica_id, REPEAT)` if this replica was asked before), then, if admitted, lists
    of `(index, Delta)` until every request ends. A cancelled call aborts what still
    runs."""
    del route  # the router's
    if self.replica_id in exclude or self._not_me(only):
      yield self.replica_id, REPEAT
      return
    loop = self._engine_loop()
    answer, streams = await loop.submit_all(submissions)
    yield self.replica_id, answer
    if streams is None:
      self.metrics.rejected(answer.status)  # (the fleet may still admit it elsewhere)
      return
    ended = [False] * len(streams)
    try:
      async for batch in _batches(streams):
        for index, delta in batch:
          ended[index] = ended[index] or delta.finish_reason is not None
        yield batch
    finally:
      for stream, done in zip(streams, ended, strict=True):
        if not done:
          loop.abort(stream.request_id, "aborted")

  async def status(self, request_id: str, only: str | None = None) -> QueueStatus | None:
    if self._not_me(only):
      return None
    return await self._engine_loop().status(request_id)

  async def metrics_text(self, only: str | None = None) -> bytes:
    return b"" if self._not_me(only) else self.metrics.render()

  async def info(self) -> dict[str, Any]:
    """What the ingress needs to know of the engines it fronts (the same on every
    replica of one recipe)."""
    scheduler = self.engine.scheduler
    return {"replica_id": self.replica_id,
            "computes_logits": self.engine.executor.computes_logits,
            "max_model_len": scheduler.max_model_len,
            "page_size": scheduler.page_pool.page_size,
            "num_pages": scheduler.page_pool.num_pages}

  async def record_routing_stats(self) -> dict[str, Any]:
    def read(engine: Engine) -> dict[str, Any]:
      stats = routing.replica_stats(self.replica_id, engine.scheduler)
      return dataclasses.asdict(stats) | {
          "prefix_pages": compact_hashes(sorted(stats.prefix_pages))}
    return await self._engine_loop().call(read)

  async def check_health(self) -> None:
    loop = self._engine_loop()
    if not loop.alive:
      raise RuntimeError(f"the engine stopped: {loop.failure}")

  def __del__(self) -> None:
    if self._loop is not None:
      self._loop.stop()


async def _batches(streams: Sequence[Stream]) -> AsyncIterator[list[tuple[int, Delta]]]:
  """The deltas of `streams` as they come, every delta ready at once in one batch (one
  message back to the ingress), until each stream has delivered its last."""
  waiting: dict[int, asyncio.Future] = {}
  live = set(range(len(streams)))
  try:
    while live:
      for index in live - waiting.keys():
        waiting[index] = asyncio.ensure_future(streams[index].next())
      await asyncio.wait(waiting.values(), return_when=asyncio.FIRST_COMPLETED)
      batch = []
      for index in [i for i, future in waiting.items() if future.done()]:
        first = waiting.pop(index).result()
        for delta in [first, *streams[index].delivered()]:
          batch.append((index, delta))
          if delta.finish_reason is not None:
            live.discard(index)
      if batch:
        yield batch
  finally:
    for future in waiting.values():
      future.cancel()


# ---------------------------------------------------------------------------------------
# The ingress: the gateway's engine side.


class FleetMetrics:
  """The ingress's own figures (the door's) and, at each scrape, every live replica's
  series with a `replica` label."""

  def __init__(self, policy: str, model_name: str):
    prom.disable_created_metrics()
    self.registry = prom.CollectorRegistry()
    self.policy = policy
    self.decisions = prom.Counter(
        "kvpage:router_decisions_total", "Requests at the fleet's door, by outcome: "
        "admitted by the first replica asked or after refusals, refused by every replica, "
        "a fault of the request itself, or no replica running.",
        ("policy", "outcome"), registry=self.registry)
    self.retries = prom.Counter(
        "kvpage:router_retries_total", "Replicas asked after one refused (a request "
        "asked of three replicas counts two).", ("policy",), registry=self.registry)
    self.rerouted = prom.Counter(
        "kvpage:router_rerouted_total", "Requests sent to another replica because theirs "
        "died before they had output.", ("policy",), registry=self.registry)
    self.lost = prom.Counter(
        "kvpage:fleet_requests_lost_total", "Requests ended with an error because their "
        "replica died after they had output.", ("policy",), registry=self.registry)
    self.rejections = prom.Counter(
        "kvpage:fleet_request_rejections_total", "Requests the fleet answered with an error "
        "status before their response started.", ("model_name", "code"),
        registry=self.registry)
    self.replicas_live = prom.Gauge("kvpage:fleet_replicas_live", "Replicas running.",
                                    registry=self.registry)
    self.replicas_target = prom.Gauge("kvpage:fleet_replicas_target",
                                      "Replicas the fleet should run.", registry=self.registry)
    for outcome in OUTCOMES:
      self.decisions.labels(policy, outcome)
    for counter in (self.retries, self.rerouted, self.lost):
      counter.labels(policy)
    for code in ("400", "429", "503"):
      self.rejections.labels(model_name, code)
    self._model_name = model_name
    self._replica_texts: dict[str, bytes] = {}
    self.registry.register(_ReplicaSeries(self))

  def rejected(self, status: int) -> None:
    self.rejections.labels(self._model_name, str(status)).inc()

  def render(self, replica_texts: dict[str, bytes]) -> bytes:
    """The exposition: the door's series, and each of `replica_texts` (by replica id)."""
    self._replica_texts = replica_texts
    try:
      return prom.generate_latest(self.registry)
    finally:
      self._replica_texts = {}


class _ReplicaSeries(prom.registry.Collector):
  """Each replica's exposition, parsed, its samples labelled with the replica; families
  of one name merged across replicas."""

  def __init__(self, metrics: FleetMetrics):
    self.metrics = metrics

  def collect(self) -> Any:
    families: dict[str, prom.Metric] = {}
    for replica_id, text in sorted(self.metrics._replica_texts.items()):
      for family in prom_parser.text_string_to_metric_families(text.decode()):
        merged = families.get(family.name)
        if merged is None:
          merged = families[family.name] = prom.Metric(family.name, family.documentation,
                                                       family.type)
        for sample in family.samples:
          merged.add_sample(sample.name, {**sample.labels, "replica": replica_id},
                            sample.value)
    yield from families.values()


@dataclasses.dataclass
class _Group:
  """The requests of one admission (n > 1: the choices of one prompt) in flight."""

  submissions: Sequence[Submission]
  route: routing.RouteRequest
  streams: list[Stream]
  replica_id: str
  call: Any  # the streaming call to the replica
  started: bool = False  # a delta other than a preemption came: the client saw output
  ended: list[bool] = dataclasses.field(default_factory=list)
  aborted: set[str] = dataclasses.field(default_factory=set)
  pump: asyncio.Task | None = None


class _ReplicaDiedError(Exception):
  """A replica's process ended under a call."""


class Fleet:
  """A running fleet: the Ray Serve application of `EngineReplica`s and its handle."""

  def __init__(self, handle: Any, name: str, num_replicas: int, policy: str,
               info: dict[str, Any], *, owns_cluster: bool):
    self.handle = handle
    self.name = name
    self.num_replicas = num_replicas
    self.policy = policy
    self.info = info
    self.view = view(name)
    self._owns_cluster = owns_cluster

  def shutdown(self) -> None:
    """Deletes the application; stops the local cluster if this fleet started it."""
    try:
      serve.delete(self.name)
    finally:
      if self._owns_cluster:
        serve.shutdown()
        ray.shutdown()
      with _VIEWS_LOCK:
        _VIEWS.pop(self.name, None)


async def _call(method: Any, *args: Any, timeout_s: float = CALL_TIMEOUT_S,
                **kwargs: Any) -> Any:
  return await asyncio.wait_for(method.remote(*args, **kwargs), timeout_s)


def start_fleet(recipe: Callable[[], ReplicaParts], *, num_replicas: int,
                policy: str = "kv_headroom", name: str = "kvpage", seed: int = 0,
                headroom_margin_pages: int = routing.HEADROOM_MARGIN_PAGES,
                wait_margin_s: float = routing.WAIT_MARGIN_S,
                ray_address: str | None = None, num_cpus: int | None = None,
                gpus_per_replica: float | None = None, devices_per_replica: int = 1,
                startup_timeout_s: float = 600.0) -> Fleet:
  """Starts `num_replicas` replicas built by `recipe` as the Ray Serve application
  `name`, routed by `policy`; joins the cluster at `ray_address`, else starts a local one
  (stopped by `Fleet.shutdown`). Each replica takes `gpus_per_replica` GPUs (None:
  `devices_per_replica` where the cluster has GPUs, else none). Returns once every
  replica is up and routable."""
  if num_replicas < 1:
    raise ValueError(f"a fleet needs at least one replica, got {num_replicas}")
  if policy not in routing.POLICIES:
    raise ValueError(f"unknown routing policy {policy!r}; choose one of "
                     f"{', '.join(routing.POLICIES)}")
  owns = not ray.is_initialized() and not ray_address
  if not ray.is_initialized():
    ray.init(address=ray_address, num_cpus=num_cpus if owns else None,
             include_dashboard=False, log_to_driver=False, configure_logging=False)
  if gpus_per_replica is None:
    gpus_per_replica = devices_per_replica if ray.cluster_resources().get("GPU", 0) else 0
  deployment = serve.deployment(
      EngineReplica, name="EngineReplica", num_replicas=num_replicas,
      max_ongoing_requests=100_000,  # the engine's own admission is the line, not Ray's
      ray_actor_options={"num_cpus": 0, "num_gpus": gpus_per_replica},
      health_check_period_s=1.0, health_check_timeout_s=5.0,
      graceful_shutdown_timeout_s=5.0,
      request_router_config=RequestRouterConfig(
          request_router_class=KvRequestRouter,
          request_router_kwargs={"fleet": name, "policy": policy, "seed": seed,
                                 "headroom_margin_pages": headroom_margin_pages,
                                 "wait_margin_s": wait_margin_s},
          request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
          request_routing_stats_timeout_s=max(1.0, 5 * ROUTING_STATS_PERIOD_S)))
  try:
    # No Ray Serve HTTP proxy: the ingress (this process) is the fleet's door.
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
    handle = serve.run(deployment.bind(recipe), name=name, route_prefix=None)
    info = asyncio.run(_first_contact(handle, name, num_replicas, startup_timeout_s))
  except BaseException:
    if owns:
      serve.shutdown()
      ray.shutdown()
    raise
  return Fleet(handle, name, num_replicas, policy, info, owns_cluster=owns)


async def _first_contact(handle: Any, name: str, num_replicas: int,
                         timeout_s: float) -> dict[str, Any]:
  """The replicas' `info`, once the router sees all of them."""
  info = await _call(handle.info, timeout_s=timeout_s)
  fleet_view = view(name)
  loop = asyncio.get_running_loop()
  deadline = loop.time() + timeout_s
  while len(fleet_view.live) < num_replicas:
    if loop.time() > deadline:
      raise TimeoutError(f"{len(fleet_view.live)} of {num_replicas} replicas up after "
                         f"{timeout_s:g} s")
    await asyncio.sleep(0.05)
  return info


class FleetBackend:
  """The gateway's backend for a fleet (`kvpage.serve.app.Backend`)."""

  def __init__(self, fleet: Fleet, model_name: str):
    self.fleet = fleet
    self.metrics = FleetMetrics(fleet.policy, model_name)
    self.computes_logits = bool(fleet.info["computes_logits"])
    self.max_model_len = int(fleet.info["max_model_len"])

  def arrival_time(self) -> None:
    return None  # each replica stamps arrival on its own clock

  def open(self, loop: asyncio.AbstractEventLoop, tokenizer: Any) -> "FleetLoop":
    del tokenizer  # each replica detokenizes its own deltas
    return FleetLoop(self.fleet, loop, self.metrics)

  def rejected(self, status: int) -> None:
    self.metrics.rejected(status)

  async def render_metrics(self) -> bytes:
    names = list(self.fleet.view.live)
    texts = await asyncio.gather(*(
        _call(self.fleet.handle.metrics_text, only=name) for name in names),
        return_exceptions=True)
    self.metrics.replicas_live.set(len(names))
    self.metrics.replicas_target.set(self.fleet.num_replicas)
    return self.metrics.render({name: text for name, text in zip(names, texts, strict=True)
                                if isinstance(text, bytes) and text})


class FleetLoop:
  """The fleet as the gateway's handlers see it (`kvpage.serve.app.Loop`)."""

  def __init__(self, fleet: Fleet, loop: asyncio.AbstractEventLoop, metrics: FleetMetrics):
    self.fleet = fleet
    self.loop = loop
    self.metrics = metrics
    self.failure: str | None = None
    self._groups: dict[str, _Group] = {}  # by request id (each request of a group)
    self._idle = asyncio.Event()
    self._idle.set()
    self._stopped = False

  @property
  def alive(self) -> bool:
    return not self._stopped

  def start(self) -> None:
    pass  # the replicas run already

  def stop(self) -> None:
    self._stopped = True
    for group in self._live_groups():
      if group.pump is not None:
        group.pump.cancel()

  def health(self) -> tuple[str, dict[str, Any]]:
    live, target = len(self.fleet.view.live), self.fleet.num_replicas
    detail = {"replicas_live": live, "replicas_target": target}
    if self._stopped:
      return "error", {"detail": "the fleet's door is closed", **detail}
    if live == 0:
      return "error", {"detail": "no replica is running", **detail}
    return ("ok" if live >= target else "degraded"), detail

  async def submit_all(self, submissions: Sequence[Submission]
                       ) -> tuple[Admission, list[Stream] | None]:
    first = submissions[0]
    request = routing.RouteRequest(
        len(first.prompt_ids), sum(s.sampling.max_tokens for s in submissions),
        compact_hashes(routing.prompt_hashes(first.prompt_ids, self.fleet.info["page_size"])))
    outcome = await self._door(submissions, request, exclude=())
    if isinstance(outcome, Admission):
      return outcome, None
    replica_id, call = outcome
    group = _Group(submissions, request,
                   [Stream(s.request_id, s.prompt_ids, self.loop) for s in submissions],
                   replica_id, call, ended=[False] * len(submissions))
    for submission in submissions:
      self._groups[submission.request_id] = group
    self._idle.clear()
    group.pump = asyncio.ensure_future(self._pump(group))
    return Admission(200, "admitted", request_id=first.request_id), group.streams

  async def _door(self, submissions: Sequence[Submission], request: routing.RouteRequest,
                  *, exclude: Sequence[str]) -> tuple[str, Any] | Admission:
    """Asks replicas in the router's order until one admits: (its id, the streaming
    call), or the fleet's refusal."""
    door = routing.Door()
    skipped = set(exclude)
    policy = self.metrics.policy
    for _ in range(2 * self.fleet.num_replicas + 2):  # a replica dying mid-answer: again
      live = set(self.fleet.view.live) - skipped
      if not live or live <= {name for name, _ in door.tried}:
        break
      call = self.fleet.handle.options(stream=True).serve.remote(
          submissions, route=request, exclude=tuple(skipped | {n for n, _ in door.tried}))
      try:
        replica_id, answer = await asyncio.wait_for(call.__anext__(), ANSWER_TIMEOUT_S)
      except (ray.exceptions.RayError, asyncio.TimeoutError, StopAsyncIteration) as error:
        call.cancel()
        log.warning("a replica failed to answer an admission call: %s", error)
        continue
      except asyncio.CancelledError:  # the client went away: whatever it admitted, aborted
        call.cancel()
        raise
      if answer == REPEAT:  # every live replica asked (a new one may not be in our view)
        call.cancel()
        skipped.add(replica_id)
        continue
      routed = door.answer(replica_id, answer)
      if routed is None:
        continue
      if routed.replica_id is None:
        self.metrics.decisions.labels(policy, "request_fault").inc()
        return routed.answer
      self.fleet.view.sent(replica_id, request)
      self.metrics.retries.labels(policy).inc(len(door.tried) - 1)
      self.metrics.decisions.labels(
          policy, "admitted_first" if len(door.tried) == 1 else "admitted_retry").inc()
      return replica_id, call
    if not door.tried:
      self.metrics.decisions.labels(policy, "no_replica").inc()
      return Admission(SERVICE_UNAVAILABLE, "no replica of the fleet is running",
                       LOST_RETRY_AFTER_S, submissions[0].request_id, "no_replica")
    self.metrics.retries.labels(policy).inc(len(door.tried) - 1)
    self.metrics.decisions.labels(policy, "refused").inc()
    return door.refused().answer

  async def _pump(self, group: _Group) -> None:
    """Feeds the group's streams from its replica; a replica that dies before any
    output is replaced through the door, after output the requests end with an error."""
    try:
      while True:
        try:
          await self._feed(group)
          return
        except _ReplicaDiedError as died:
          if not group.started and not group.aborted:
            outcome = await self._door(group.submissions, group.route,
                                       exclude=(group.replica_id,))
            if not isinstance(outcome, Admission):
              self.metrics.rerouted.labels(self.metrics.policy).inc()
              group.replica_id, group.call = outcome
              continue
            error = f"{REPLICA_LOST} ({died}); no other replica took the request"
          else:
            self.metrics.lost.labels(self.metrics.policy).inc()
            error = f"{REPLICA_LOST} ({died})"
          self._end(group, Delta(finish_reason="error", error=error))
          return
    except asyncio.CancelledError:
      group.call.cancel()  # the replica aborts what it still runs
      self._end(group, Delta(finish_reason="abort"))
      raise
    finally:
      self._forget(group)

  async def _feed(self, group: _Group) -> None:
    try:
      async for batch in group.call:
        for index, delta in batch:
          group.started = group.started or not delta.preempted
          group.ended[index] = group.ended[index] or delta.finish_reason is not None
          group.streams[index].deliver(delta)
    except ray.exceptions.RayError as error:
      raise _ReplicaDiedError(f"{type(error).__name__} on replica {group.replica_id}") from None
    if not all(group.ended):  # the call ended early: its replica went away
      raise _ReplicaDiedError(f"replica {group.replica_id}'s stream ended early")

  def _end(self, group: _Group, delta: Delta) -> None:
    for index, stream in enumerate(group.streams):
      if not group.ended[index]:
        group.ended[index] = True
        stream.deliver(delta)

  def _forget(self, group: _Group) -> None:
    for submission in group.submissions:
      if self._groups.get(submission.request_id) is group:
        del self._groups[submission.request_id]
    if not self._groups:
      self._idle.set()

  def _live_groups(self) -> list[_Group]:
    return list({id(group): group for group in self._groups.values()}.values())

  def abort(self, request_id: str, reason: str = "aborted") -> None:
    """Ends a live request; once every live request of its group is aborted, the call
    to its replica is cancelled (the replica aborts them: their pages are free)."""
    del reason
    group = self._groups.get(request_id)
    if group is None:
      return
    group.aborted.add(request_id)
    live = {s.request_id for s, ended in zip(group.submissions, group.ended, strict=True)
            if not ended}
    if live <= group.aborted and group.pump is not None:
      group.pump.cancel()

  async def status(self, request_id: str) -> QueueStatus | None:
    group = self._groups.get(request_id)
    if group is None:
      return None
    try:
      return await _call(self.fleet.handle.status, request_id, only=group.replica_id)
    except (ray.exceptions.RayError, asyncio.TimeoutError):
      return None

  async def wait_idle(self, timeout_s: float) -> bool:
    try:
      await asyncio.wait_for(self._idle.wait(), timeout_s)
      return True
    except asyncio.TimeoutError:
      return False

  async def abort_all(self) -> int:
    groups = self._live_groups()
    count = sum(g.ended.count(False) for g in groups)
    pumps = [g.pump for g in groups if g.pump is not None]
    for pump in pumps:
      pump.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)
    return count


def fleet_banner(fleet: Fleet) -> str:
  """One line for the command's output."""
  return (f"{fleet.num_replicas} replica{'s' if fleet.num_replicas != 1 else ''} on Ray Serve "
          f"{ray.__version__}, routed by {fleet.policy}, {fleet.info['num_pages']:,} KV pages "
          f"each")
