"""The fleet on Ray Serve, end to end: `python -m experiments.serve --replicas=N`.

One command process per fleet: it starts a local Ray cluster (2 CPUs), the replicas
(simulated engines, paced in real time: cheap), and serves HTTP as the single server
does. The tests drive it as clients would, over HTTP and with the openai client, and
kill a replica's process as a fault would. The last test serves the real tiny model
from one replica.

Which replica a request meets, and which refuses it, is made deterministic, whatever
the machine's load: the round-robin policy (the replicas in a fixed order, each call
for an admission the next turn), and replicas that run one request at a time and hold
one more waiting (`max_num_seqs=1`, `max_waiting=1`): a replica running one long
request and holding another refuses a third (its queue is full, and so are its pages).
"""

import concurrent.futures
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("ray", reason="the fleet extra is not installed")

from serve_utils import ServerProcess, make_served_checkpoint, metric

# 2,000 tokens to generate: seconds of simulated steps, a replica's one running request.
LONG = {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True}
SMALL = {"prompt": [5, 6, 7], "max_tokens": 2}
NUM_REPLICAS = 2
FLEET_FLAGS = ("--executor=sim", f"--replicas={NUM_REPLICAS}", "--ray_cpus=2",
               "--router=round_robin", "--max_num_seqs=1", "--config.scheduler.max_waiting=1",
               "--drain_timeout_s=30")  # (a loaded machine's steps are slower than paced)


@pytest.fixture(scope="module")
def fleet(cache_dir):
  server = ServerProcess(*FLEET_FLAGS, cache_dir=cache_dir)
  yield server
  assert server.stop() == 0, "".join(server.stderr)
  log = "".join(server.stderr)
  assert "Traceback" not in log, log
  assert not _replica_pids(server), "the fleet's replicas outlived the command"


def _replica_pids(server: ServerProcess) -> list[int]:
  """The pids of the fleet's replica processes: descendants of the command's process."""
  parents: dict[int, int] = {}
  commands: dict[int, str] = {}
  for entry in pathlib.Path("/proc").iterdir():
    if not entry.name.isdigit():
      continue
    try:
      stat = (entry / "stat").read_text()
      commands[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
      continue
    parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
  root = server.process.pid

  def descends(pid: int) -> bool:
    while pid > 1:
      if pid == root:
        return True
      pid = parents.get(pid, 0)
    return False
  return sorted(pid for pid, command in commands.items()
                if "ServeReplica:kvpage:EngineReplica" in command and descends(pid))


def _post(server: ServerProcess, body: dict, **kwargs) -> httpx.Response:
  return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60, **kwargs)


def _metrics(server: ServerProcess) -> str:
  return httpx.get(f"{server.url}/metrics", timeout=30).text


def _reporting(text: str) -> set[str]:
  """The replicas whose own series are in the fleet's metrics."""
  return {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
          if line.startswith("kvpage:num_requests_running{")}


def _idle(server: ServerProcess, timeout_s: float = 30) -> str:
  """The metrics once every replica reports its own series and none runs or holds
  anything (fails after `timeout_s`). A replica whose scrape failed is left out of the
  fleet's metrics, so a sum alone would read its pages as free."""
  deadline = time.monotonic() + timeout_s
  while True:
    text = _metrics(server)
    live = sum(metric(text, f"kvpage:num_requests_{state}")
               for state in ("running", "waiting", "swapped"))
    if (len(_reporting(text)) == NUM_REPLICAS == metric(text, "kvpage:fleet_replicas_live")
        and live == 0 and metric(text, "kvpage:kv_cache_usage_perc") == 0):
      return text
    assert time.monotonic() < deadline, f"the fleet is not idle:\n{text}"
    time.sleep(0.2)


class _Held:
  """A streamed request on a thread: its status, its events, how it ended."""

  def __init__(self, server: ServerProcess, body: dict):
    self.status: int | None = None
    self.events: list[dict] = []
    self.answered = threading.Event()  # the status came (admitted: the stream is open)
    self.started = threading.Event()  # the first event came (a token, or an error)
    self.thread = threading.Thread(target=self._run, args=(server, body), daemon=True)
    self.thread.start()

  def _run(self, server: ServerProcess, body: dict) -> None:
    with (httpx.Client(timeout=120) as client,
          client.stream("POST", f"{server.url}/v1/completions",
                        json={**body, "stream": True}) as response):
      self.status = response.status_code
      self.answered.set()
      for line in response.iter_lines():
        if line.startswith("data: {"):
          self.events.append(json.loads(line.removeprefix("data: ")))
          self.started.set()
    self.answered.set()
    self.started.set()

  def join(self) -> "_Held":
    self.thread.join(120)
    assert not self.thread.is_alive(), "a stream did not end"
    return self

  @property
  def finish(self) -> str | None:
    for event in self.events:
      if "error" in event:
        return "error:" + event["error"]["code"]
      reason = event["choices"][0]["finish_reason"] if event.get("choices") else None
      if reason:
        return reason
    return None


def test_openai_client_streaming_equals_whole(fleet):
  import openai

  client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0)
  whole = client.completions.create(model="tiny", prompt=[11, 12, 13, 14], max_tokens=12)
  assert whole.choices[0].finish_reason == "length"
  assert whole.usage.prompt_tokens == 4 and whole.usage.completion_tokens == 12
  tokens, finish = [], None
  for chunk in client.completions.create(model="tiny", prompt=[11, 12, 13, 14],
                                         max_tokens=12, stream=True):
    tokens += chunk.choices[0].model_extra["token_ids"]
    finish = chunk.choices[0].finish_reason or finish
  assert tokens == whole.choices[0].model_extra["token_ids"] and finish == "length"
  health = httpx.get(f"{fleet.url}/health", timeout=10).json()
  assert health == {"status": "ok", "replicas_live": 2, "replicas_target": 2}
  text = _idle(fleet)  # (every replica's series, labelled with its replica)
  assert metric(text, "kvpage:router_decisions_total", outcome="admitted_first") >= 2


def test_refused_by_one_replica_served_by_the_other_then_pushed_back(fleet):
  """Round robin, turn by turn (a retry takes a turn too): A runs on replica X, a small
  request on Y ends, C waits on X, a small one on Y ends; E meets X first, which refuses
  it (its queue is full), and Y admits it; F meets X, refused, and waits on Y; now
  every replica runs one and holds one: G is refused by both, and only then does the
  client get a push-back, with a retry hint."""
  before = _idle(fleet)

  def decisions(text: str, outcome: str) -> float:
    return (metric(text, "kvpage:router_decisions_total", outcome=outcome)
            - metric(before, "kvpage:router_decisions_total", outcome=outcome))

  held = [_Held(fleet, LONG)]
  assert held[0].started.wait(30) and held[0].status == 200
  for _ in range(2):
    assert _post(fleet, SMALL).status_code == 200
    if len(held) == 1:
      held.append(_Held(fleet, LONG))  # C: waits on X
      assert held[-1].answered.wait(30)
  for _ in range(2):  # E, F
    held.append(_Held(fleet, LONG))
    assert held[-1].answered.wait(30)
  assert [h.status for h in held] == [200] * 4
  refused = _post(fleet, LONG)  # G
  # (its queue, or the pages the two it holds are promised: whichever line X checks first)
  assert refused.status_code in (429, 503), refused.text
  assert refused.json()["error"]["code"] in ("queue_full", "kv_pressure")
  assert "every replica refused (2)" in refused.json()["error"]["message"]
  assert float(refused.headers["retry-after-ms"]) > 0 and int(refused.headers["retry-after"]) >= 1
  text = _metrics(fleet)
  assert decisions(text, "admitted_retry") == 2, "E and F: refused by X, admitted by Y"
  assert decisions(text, "refused") == 1
  assert (metric(text, "kvpage:router_retries_total")
          - metric(before, "kvpage:router_retries_total")) == 3  # E, F and G asked Y too
  assert metric(text, "kvpage:fleet_request_rejections_total",
                code=str(refused.status_code)) >= 1
  assert [h.join().finish for h in held] == ["length"] * 4
  _idle(fleet)


def test_disconnect_storm_leaks_no_page(fleet):
  """Clients that go away mid-stream and mid-wait: every replica ends idle."""
  def gone(index: int) -> bool:
    """Whether its stream was admitted (and then cut)."""
    body = {"prompt": [7 + index % 50] * (20 + index), "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    try:
      with (httpx.Client(timeout=30) as client,
            client.stream("POST", f"{fleet.url}/v1/completions", json=body) as response):
        for _ in response.iter_lines():
          break  # the first line, then away
        return response.status_code == 200
    except httpx.HTTPError:
      return False

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    admitted = sum(pool.map(gone, range(64)))
  # An idle fleet admits the first request each replica meets: at least those were cut
  # mid-stream (the rest were refused: each replica runs one and holds one).
  assert admitted >= NUM_REPLICAS
  _idle(fleet)
  assert _post(fleet, SMALL).status_code == 200


class _HealthWatch:
  """`/health` asked every 50 ms on a thread: the statuses it said, in order (each
  answer must be a 200: a degraded fleet still serves)."""

  def __init__(self, server: ServerProcess):
    self.seen: list[str] = []
    self.last: str | None = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, args=(server,), daemon=True)
    self._thread.start()

  def _run(self, server: ServerProcess) -> None:
    with httpx.Client(timeout=10) as client:
      while not self._stop.is_set():
        try:
          answer = client.get(f"{server.url}/health")
          status = answer.json()["status"] if answer.status_code == 200 else (
              f"HTTP {answer.status_code}: {answer.text}")
        except httpx.HTTPError as error:
          status = f"{type(error).__name__}: {error}"
        if not self.seen or self.seen[-1] != status:
          self.seen.append(status)
        self.last = status
        self._stop.wait(0.05)

  def stop(self) -> list[str]:
    self._stop.set()
    self._thread.join(30)
    return self.seen


def test_killed_replica_ends_its_streams_others_finish_and_it_comes_back(fleet):
  """A runs on replica X, B on Y, W waits on X; X's process is killed. A had output: it
  ends with an error event. W had none: it is routed again, to Y, where it waits for B
  and then runs. B is untouched. Ray starts X again; /health says degraded till then."""
  pids = _replica_pids(fleet)
  assert len(pids) == 2, pids
  before = _idle(fleet)
  first = _Held(fleet, LONG)
  assert first.started.wait(30) and first.status == 200
  streams = [first, _Held(fleet, LONG)]
  assert streams[1].started.wait(30) and streams[1].status == 200
  streams.append(_Held(fleet, LONG))
  assert streams[2].answered.wait(30) and streams[2].status == 200
  text = _metrics(fleet)
  holding = [line.split('replica="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("kvpage:num_requests_waiting{") and line.endswith(" 1.0")]
  assert len(holding) == 1, text
  victim = int(next(line.split('pid="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith("kvpage:replica_info{")
                    and f'replica="{holding[0]}"' in line))
  assert victim in pids
  health = _HealthWatch(fleet)  # from the kill on: Ray may restart X before B ends
  os.kill(victim, signal.SIGKILL)
  ends = [held.join().finish for held in streams]
  assert ends == ["error:replica_lost", "length", "length"], ends
  deadline = time.monotonic() + 90
  while not (health.last == "ok" and len(_replica_pids(fleet)) == 2):
    assert time.monotonic() < deadline, f"the replica did not come back: {health.seen}"
    time.sleep(0.1)
  assert "degraded" in health.stop(), health.seen
  text = _idle(fleet)
  assert metric(text, "kvpage:fleet_requests_lost_total") - metric(
      before, "kvpage:fleet_requests_lost_total") == 1
  assert metric(text, "kvpage:router_rerouted_total") - metric(
      before, "kvpage:router_rerouted_total") == 1
  assert [_post(fleet, SMALL).status_code for _ in range(4)] == [200] * 4


def test_sigterm_drains_the_fleet(fleet):
  """The last test of the module's fleet: SIGTERM drains the door as the single server
  drains (new requests 503 `draining`, live ones finish), then the replicas and the
  local cluster stop (the fixture checks that no replica outlives the command)."""
  held = _Held(fleet, {**LONG, "max_tokens": 1000})  # well within the drain timeout
  assert held.started.wait(30) and held.status == 200
  fleet.process.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + 10
  while True:
    late = _post(fleet, SMALL)
    if late.status_code == 503:
      break
    assert late.status_code == 200 and time.monotonic() < deadline, late.text
    time.sleep(0.05)
  assert late.json()["error"]["code"] == "draining"
  assert held.join().finish == "length"
  assert fleet.process.wait(60) == 0


def test_real_model_replica_smoke(tmp_path_factory, cache_dir):
  """One replica serving the tiny text model: text in, text out, streamed as whole."""
  checkpoint = make_served_checkpoint(tmp_path_factory.mktemp("served"))
  server = ServerProcess(f"--checkpoint={checkpoint}", "--replicas=1", "--ray_cpus=2",
                         "--num_pages=48", "--max_num_seqs=4", "--max_num_batched_tokens=64",
                         "--chunk_size=32", "--warmup_sampling=false",
                         cache_dir=cache_dir)
  try:
    body = {"prompt": "The cache", "max_tokens": 6, "temperature": 0}
    whole = _post(server, body)
    assert whole.status_code == 200, whole.text
    text, finish = "", None
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
      for line in response.iter_lines():
        if line.startswith("data: {"):
          choice = json.loads(line.removeprefix("data: "))["choices"][0]
          text += choice["text"]
          finish = choice["finish_reason"] or finish
    assert text == whole.json()["choices"][0]["text"] and finish == "length"
  finally:
    assert server.stop() == 0, "".join(server.stderr)
  assert "Traceback" not in "".join(server.stderr)


class _Replica:
  """What Ray's router hands `choose_replicas`: an id and the last routing stats."""

  def __init__(self, unique_id: str, **stats):
    self.replica_id = type("ReplicaID", (), {"unique_id": unique_id})()
    self.routing_stats = stats


class _Pending:
  def __init__(self, **kwargs):
    self.kwargs = kwargs


def test_request_router_ranks_by_policy_honours_exclude_and_pins():
  """The adapter alone (no cluster): routing stats become `ReplicaStats`, the policy
  ranks, replicas already asked are left out, and a call for one replica goes there."""
  import asyncio

  from kvpage.host import routing
  from kvpage.serve import ray_fleet

  router = object.__new__(ray_fleet.KvRequestRouter)  # (Ray builds it with its own state)
  router.initialize_state(fleet="test-adapter", policy="prefix_affinity",
                          headroom_margin_pages=50)
  prompt = list(range(40))
  hashes = ray_fleet.compact_hashes(routing.prompt_hashes(prompt, 16))
  replicas = [_Replica("a", headroom_pages=100, page_size=16, taken_at=1.0),
              _Replica("b", headroom_pages=60, page_size=16, taken_at=1.0,
                       prefix_pages=list(hashes)),
              _Replica("c", headroom_pages=10, page_size=16, taken_at=1.0)]
  request = routing.RouteRequest(len(prompt), 8, hashes)

  def choose(**kwargs) -> list[list[str]]:
    ranked = asyncio.run(router.choose_replicas(replicas, _Pending(**kwargs)))
    return [[r.replica_id.unique_id for r in group] for group in ranked]

  assert choose(route=request) == [["b"], ["a"], ["c"]]  # its prefix, within the margin
  assert choose(route=request, exclude=("b",)) == [["a"], ["c"]]
  assert choose(route=request, exclude=("a", "b", "c")) == [["a", "b", "c"]]  # one repeats
  assert choose(only="c") == [["c"]]
  assert choose(only="gone") == [["a", "b", "c"]]  # (a replica not this one says so)
  assert choose() == [["a", "b", "c"]]  # not an admission: any
  ray_fleet.view("test-adapter").sent("a", routing.RouteRequest(16 * 50, 0))
  replicas[1].routing_stats = {"headroom_pages": 60, "page_size": 16, "taken_at": 2.0}
  assert choose(route=request) == [["b"], ["a"], ["c"]]  # a: 100 - 50 sent < 60: b (no prefix now)


def test_a_fleet_refuses_retry_reservations(cache_dir):
  """A place in line is held on the replica that refused, but the door asks the next
  replica at once: the place would hold pages for a request served elsewhere. One
  `error:` line, exit 2, before any cluster starts."""
  done = subprocess.run(
      [sys.executable, "-m", "experiments.serve", "--host=127.0.0.1", "--port=0",
       f"--compilation_cache={cache_dir}", *FLEET_FLAGS,
       "--config.server.retry_reservations=true"],
      cwd=pathlib.Path(__file__).resolve().parents[1], capture_output=True, text=True,
      timeout=300)
  assert done.returncode == 2 and done.stdout == "", done.stdout
  lines = done.stderr.strip().splitlines()
  assert lines == ["error: retry_reservations holds a refused request's place on one "
                   "engine; a fleet's door tries the other replicas at once, so it is not "
                   "supported with --replicas"], lines
