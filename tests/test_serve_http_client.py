"""The HTTP load client (`benchmarks/serve_http.py`, its core `benchmarks/load_client.py`)
against a fake OpenAI-compatible server run in-process on 127.0.0.1: streams parsed and
timed, retry hints honoured and counted, retries bounded, the wall bound kept, the
record written, and any host other than this machine refused."""

import asyncio
import itertools
import json
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest

from experiments import cli

# The client needs aiohttp; its fake server, FastAPI and uvicorn; httpx builds headers
# here. None is a kvpage dependency.
pytest.importorskip("aiohttp")
httpx = pytest.importorskip("httpx")
fastapi = pytest.importorskip("fastapi")
responses = pytest.importorskip("fastapi.responses")
uvicorn = pytest.importorskip("uvicorn")

from benchmarks import load_client as serve_http  # noqa: E402  (after the skips: aiohttp)

ROOT = pathlib.Path(__file__).resolve().parents[1]
HINTS = {"retry-after-ms": "50", "retry-after": "1"}  # the ms hint wins: 0.05 s, not 1 s


class FakeServer:
  """What the fake server does, set per test, and what it saw.

  Each POST takes the next answer of `rejections` (status, headers) while any is left;
  otherwise it streams `num_chunks` content chunks `chunk_delay_s` apart, with two SSE
  comments and one status chunk along the way, then the usage chunk and `[DONE]`.
  """

  def __init__(self) -> None:
    self.url = ""
    self.reset()

  def reset(self) -> None:
    self.rejections: list[tuple[int, dict[str, str]]] = []
    self.num_chunks, self.chunk_delay_s = 4, 0.01
    self.send_usage, self.send_done, self.error_event = True, True, False
    self.posts: list[tuple[float, dict]] = []  # (time.perf_counter(), body) of each POST
    self.request_ids: list[str | None] = []  # the x-request-id header of each POST
    self.in_flight = self.max_in_flight = 0

  async def stream(self, chat: bool, prompt_tokens: int):
    self.in_flight += 1
    self.max_in_flight = max(self.max_in_flight, self.in_flight)
    try:
      yield ": queued\n\n"
      yield _data({"id": "x", "choices": [], "status": {"state": "running"}})
      if chat:  # the role comes first, with no content: not a token
        yield _data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
      for i in range(self.num_chunks):
        await asyncio.sleep(self.chunk_delay_s)
        finish = "length" if i == self.num_chunks - 1 else None
        piece = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
        yield _data({"choices": [{"index": 0, "finish_reason": finish, **piece}]})
        if i == 0:
          yield ": still decoding\n\n"
      if self.error_event:
        yield _data({"error": {"message": "the engine fell over", "code": 500}})
      if self.send_usage:
        yield _data({"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                              "completion_tokens": self.num_chunks}})
      if self.send_done:
        yield "data: [DONE]\n\n"
    finally:
      self.in_flight -= 1


def _data(chunk: dict) -> str:
  return f"data: {json.dumps(chunk)}\n\n"


def make_app(state: FakeServer):
  app = fastapi.FastAPI()

  @app.get("/v1/models")
  def models() -> dict:
    return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

  async def complete(request: fastapi.Request):
    body = await request.json()
    state.posts.append((time.perf_counter(), body))
    state.request_ids.append(request.headers.get("x-request-id"))
    if state.rejections:
      status, headers = state.rejections.pop(0)
      return responses.JSONResponse({"error": {"message": "busy"}}, status_code=status,
                                    headers=headers)
    chat = request.url.path.endswith("/chat/completions")
    prompt_tokens = len(body["messages"][0]["content"].split()) if chat else len(body["prompt"])
    return responses.StreamingResponse(state.stream(chat, prompt_tokens),
                                       media_type="text/event-stream")

  app.post("/v1/completions")(complete)
  app.post("/v1/chat/completions")(complete)
  return app


@pytest.fixture(scope="module")
def running_server():
  state = FakeServer()
  sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  sock.bind(("127.0.0.1", 0))  # an ephemeral port, known before the server starts
  state.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
  config = uvicorn.Config(make_app(state), log_level="warning", lifespan="off",
                          timeout_graceful_shutdown=1)
  server = uvicorn.Server(config)
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  deadline = time.monotonic() + 10
  while not server.started:
    assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
    time.sleep(0.01)
  yield state
  server.should_exit = True
  thread.join(timeout=5)
  sock.close()


@pytest.fixture
def server(running_server: FakeServer) -> FakeServer:
  running_server.reset()
  return running_server


def load(server: FakeServer, **overrides) -> serve_http.LoadResult:
  config = serve_http.LoadConfig(url=server.url, **overrides)
  return asyncio.run(serve_http.run_load(config))


def gaps_between_posts(server: FakeServer) -> list[float]:
  return [b - a for a, b in itertools.pairwise(t for t, _ in server.posts)]


# Streams.
def test_streams_are_parsed_and_timed(server):
  server.num_chunks, server.chunk_delay_s = 5, 0.02
  result = load(server, num_requests=3, prompt_len=16, output_len=5)
  assert result.model == "fake-model"  # the first id of GET /v1/models
  assert result.server_models["data"][0]["id"] == "fake-model"
  for record in result.requests:
    assert record.outcome == "served", record.error
    assert [a.status for a in record.attempts] == [200]
    assert record.output_tokens == 5 and len(record.chunk_times_s) == 5
    assert record.status_comments == 2 and record.status_chunks == 1  # neither is a token
    assert record.finish_reason == "length"
    assert record.ttft_s >= 0.02 and record.ttft_incl_retries_s == record.ttft_s
    # The server sleeps 0.02 s before each chunk; a busy machine may bunch two chunks up.
    assert len(record.itl_s) == 4 and sum(record.itl_s) == pytest.approx(
        record.chunk_times_s[-1] - record.chunk_times_s[0])
    assert record.tpot_s == pytest.approx(sum(record.itl_s) / 4) and record.tpot_s >= 0.01
  summary = serve_http.summarize(result)
  assert (summary["sent"], summary["served"], summary["failed"], summary["unfinished"]) == (
      3, 3, 0, 0)
  assert summary["output_tokens"] == 15 and summary["status_comments"] == 6
  assert summary["ttft_s"]["p50"] >= 0.02 and summary["tpot_s"]["p99"] >= 0.01
  assert summary["output_tokens_per_s"] > 0 and summary["requests_per_s"] > 0
  for _, body in server.posts:
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 5
    assert len(body["prompt"]) == 16 and all(10 <= t < 500 for t in body["prompt"])


def test_chat_counts_content_chunks_without_usage(server):
  server.send_usage = False
  result = load(server, endpoint="chat", num_requests=1, prompt_len=7, ignore_eos=False)
  (record,) = result.requests
  assert record.outcome == "served" and record.usage_tokens is None
  assert record.output_tokens == 4  # the content chunks; the role-only chunk is not one
  (_, body) = server.posts[0]
  assert len(body["messages"][0]["content"].split()) == 7 and "ignore_eos" not in body


@pytest.mark.parametrize("knob, failure", [("error_event", "stream_error"),
                                           ("send_done", "bad_stream")])
def test_a_broken_stream_fails_the_request(server, knob, failure):
  setattr(server, knob, not getattr(server, knob))
  (record,) = load(server, num_requests=1).requests
  assert (record.outcome, record.failure) == ("failed", failure)
  if knob == "error_event":
    assert record.stream_errors[0]["message"] == "the engine fell over"


# Rejections and retries.
def test_retries_wait_the_servers_hint_and_are_counted(server):
  server.rejections = [(429, HINTS), (503, HINTS)]
  (record,) = load(server, num_requests=1).requests
  assert record.outcome == "served"
  assert [a.status for a in record.attempts] == [429, 503, 200]
  assert [a.wait_s for a in record.attempts] == [0.0, 0.05, 0.05]
  assert [a.honoured_hint for a in record.attempts] == [False, True, True]
  assert all(gap >= 0.05 for gap in gaps_between_posts(server))
  assert record.ttft_incl_retries_s >= record.ttft_s + 0.1
  summary = serve_http.summarize(serve_http.LoadResult(
      config=serve_http.LoadConfig(url=server.url), model="m", server_models=None,
      started_at="", wall_s=1.0, requests=[record]))
  assert summary["rejections"] == {"429": 1, "503": 1} and summary["num_rejections"] == 2
  assert summary["retries"] == summary["retries_on_hint"] == 2
  assert summary["requests_rejected"] == summary["served_after_rejection"] == 1
  assert summary["rejected_served_fraction"] == 1.0
  assert summary["retry_wait_total_s"] == pytest.approx(0.1)
  assert summary["retry_wait_mean_s"] == pytest.approx(0.05)


def test_a_retry_sends_back_the_id_it_was_refused_under(server):
  """kvpage names the place a refused request holds in line (`x-request-id` on the
  429/503); a retry that sends it back keeps that place."""
  server.rejections = [(503, {**HINTS, "x-request-id": "cmpl-place"}), (429, HINTS)]
  (record,) = load(server, num_requests=1).requests
  assert [a.status for a in record.attempts] == [503, 429, 200]
  # The first try names none; the second sends back the first refusal's; the third
  # none, as the second refusal named none.
  assert server.request_ids == [None, "cmpl-place", None]


def test_retries_stop_after_max_retries(server):
  server.rejections = [(429, {"retry-after-ms": "10"})] * 5
  result = load(server, num_requests=1, max_retries=2)
  (record,) = result.requests
  assert (record.outcome, record.failure) == ("failed", "rejected")
  assert len(server.posts) == 3 and len(server.rejections) == 2
  summary = serve_http.summarize(result)
  assert summary["num_rejections"] == 3 and summary["retries"] == 2
  assert summary["served_after_rejection"] == 0 and summary["rejected_served_fraction"] == 0.0


@pytest.mark.parametrize("headers, reason", [
    ({**HINTS, "x-should-retry": "false"}, "x-should-retry: false"),
    ({"retry-after": "121"}, "more than the 120 s cap"),
])
def test_no_retry_when_the_server_says_so_or_asks_too_much(server, headers, reason):
  server.rejections = [(503, headers)]
  (record,) = load(server, num_requests=1).requests
  assert (record.outcome, record.failure) == ("failed", "not_retried")
  assert reason in record.error and len(server.posts) == 1


def test_without_honouring_hints_the_client_backs_off(server):
  server.rejections = [(429, HINTS)]
  (record,) = load(server, num_requests=1, honor_retry_after=False).requests
  assert record.outcome == "served"
  assert record.attempts[1].wait_s == 0.5 and not record.attempts[1].honoured_hint
  assert record.attempts[0].hint_s == 0.05  # still recorded
  assert gaps_between_posts(server)[0] >= 0.5


def test_hints_and_backoff():
  hint = lambda **headers: serve_http.retry_hint_s(httpx.Headers(headers))
  assert hint(**{"Retry-After-Ms": "250", "Retry-After": "3"}) == 0.25
  assert hint(**{"Retry-After": "3"}) == 3.0
  assert hint(**{"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0  # a past date
  assert hint(**{"Retry-After": "soon"}) is None and hint() is None
  assert hint(**{"retry-after-ms": "nan", "retry-after": "2"}) == 2.0
  waits = [serve_http.plan_retry(httpx.Headers(), n).wait_s for n in range(10)]
  assert waits[:4] == [0.5, 1.0, 2.0, 4.0] and max(waits) == serve_http.MAX_WAIT_S
  plan = serve_http.plan_retry(httpx.Headers({"retry-after": "120"}), 0)
  assert plan.wait_s == 120.0 and plan.honoured_hint


# Arrivals, concurrency and the wall bound.
def test_concurrency_is_capped(server):
  server.chunk_delay_s = 0.02
  result = load(server, num_requests=6, max_concurrency=2)
  assert all(record.outcome == "served" for record in result.requests)
  assert server.max_in_flight == 2


def test_arrivals_follow_the_seeded_rate(server):
  result = load(server, num_requests=5, request_rate=40.0, seed=3)
  config = result.config
  assert [r.scheduled_s for r in result.requests] == serve_http.arrival_times(config)
  scheduled = [r.scheduled_s for r in result.requests]
  assert scheduled[0] == 0.0 and scheduled == sorted(scheduled) and scheduled[-1] > 0
  assert all(r.attempts[0].send_s >= r.scheduled_s - 1e-3 for r in result.requests)
  at_once = serve_http.LoadConfig(num_requests=5, seed=3)
  assert serve_http.arrival_times(at_once) == [0.0] * 5
  assert serve_http.make_prompts(at_once) == serve_http.make_prompts(config)  # rate-free
  assert serve_http.make_prompts(serve_http.LoadConfig(num_requests=5, seed=4)) != (
      serve_http.make_prompts(config))


def test_the_run_stops_at_timeout_s(server):
  server.num_chunks, server.chunk_delay_s = 5, 0.1  # >= 0.5 s a request, one at a time
  result = load(server, num_requests=3, max_concurrency=1, timeout_s=0.9)
  assert [r.outcome for r in result.requests] == ["served", "unfinished", "unfinished"]
  assert 0.9 <= result.wall_s < 1.5
  assert result.requests[1].chunk_times_s  # cancelled mid-stream, its partial record kept
  summary = serve_http.summarize(result)
  assert (summary["served"], summary["unfinished"], summary["unsent"]) == (1, 2, 1)
  assert summary["sent"] == 2 and summary["failed"] == 0


def test_without_a_server_there_is_no_model_to_ask_for(tmp_path):
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens
    with pytest.raises(ValueError, match="pass --model"):
      asyncio.run(serve_http.run_load(serve_http.LoadConfig(url=url)))
    result = asyncio.run(serve_http.run_load(serve_http.LoadConfig(url=url, model="m",
                                                                  num_requests=2)))
  assert result.server_models is None
  assert [r.failure for r in result.requests] == ["transport", "transport"]


# The entry point.
def test_main_prints_a_table_and_writes_the_record(server, tmp_path):
  # A process of its own: the entry point's flags would clash with other entry points'.
  output = tmp_path / "new" / "result.json"
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.serve_http", f"--url={server.url}/v1",
       "--num_requests=2", f"--output={output}", "--label=fake engine"], cwd=ROOT,
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "TTFT" in result.stdout
  record = json.loads(output.read_text())
  assert set(record) == {"label", "premises", "summary", "requests"}
  assert record["label"] == "fake engine"
  premises = record["premises"]
  assert premises["model"] == "fake-model" and premises["endpoint"] == "completions"
  assert premises["config"]["request_rate"] == "inf" and premises["output"] == str(output)
  assert premises["config"]["max_retries"] == 3 and premises["server_models"]["data"]
  assert {"python", "aiohttp", "hostname", "started_at", "url"} <= set(premises)
  assert record["summary"]["served"] == 2 and len(record["requests"]) == 2
  assert record["requests"][0]["attempts"][0]["status"] == 200


@pytest.mark.parametrize("url", ["http://example.com", "http://127.0.0.1.nip.io:8000",
                                 "http://10.0.0.1:8000", "ftp://127.0.0.1", "127.0.0.1:8000",
                                 "http://localhost:99999"])
def test_only_loopback_urls_are_accepted(url):
  with pytest.raises(ValueError):
    serve_http.LoadConfig(url=url)


@pytest.mark.parametrize("url, base_url", [
    ("http://localhost:8000/v1/", "http://localhost:8000"),
    ("http://[::1]:8000", "http://[::1]:8000"),
    ("https://127.0.0.1", "https://127.0.0.1"),
    ("http://LOCALHOST", "http://LOCALHOST"),
])
def test_loopback_urls_are_accepted(url, base_url):
  assert serve_http.LoadConfig(url=url).base_url == base_url


def test_a_remote_url_is_refused_in_one_line(tmp_path):
  output = tmp_path / "never" / "result.json"
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.serve_http", "--url=http://192.0.2.1:8000",
       f"--output={output}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert result.returncode == cli.USAGE_ERROR
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith("error: ") and "loopback" in line and "192.0.2.1" in line
  assert not output.parent.exists()


# The HTTP floor (`benchmarks/http_floor.py`): what `http_overhead` compares against.
def test_the_http_floor_app_answers_every_request_with_one_chunk():
  process = subprocess.Popen([sys.executable, "-m", "benchmarks.http_floor"], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
  try:
    line = process.stdout.readline()  # the line http_overhead's start_server parses
    assert line.startswith("http_floor on http://127.0.0.1:"), line
    url = line.split()[2]
    result = asyncio.run(serve_http.run_load(serve_http.LoadConfig(
        url=url, num_requests=6, request_rate=200.0, prompt_len=8, output_len=4)))
  finally:
    process.terminate()
    process.wait(10)
  assert result.model == "floor"  # named by its GET /v1/models
  for record in result.requests:
    assert record.outcome == "served", record.error
    assert len(record.chunk_times_s) == 1 and record.finish_reason == "length"
    assert 0 < record.ttft_s < 5
