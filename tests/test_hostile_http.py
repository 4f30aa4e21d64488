"""The gateway exposed to hostile and careless clients: a real server on 127.0.0.1.

One server (a tiny checkpoint with a real tokenizer, two API keys, at most 64
connections, one-second head and body timeouts) meets what an exposed server meets
first: bad keys, hosts and media types; bodies that nest, overflow, lie about their
length or carry lone surrogates; prompts far past the context; headers too many or too
large or sent a byte at a time; idle connections past the cap; a fuzzer. Throughout, it
answers no 5xx, logs no traceback, keeps `/health` fast, and leaks no page. A second
process (the simulated GPU: no compile) holds 10,000 idle connections. Drains at
0, 0.1 and 2 s with streams in flight end without an exception in any thread.
"""

import asyncio
import contextlib
import http.client
import json
import logging
import pathlib
import resource
import socket
import threading
import time

import hypothesis
import pytest
from engine_utils import default_sample, fake_engine
from hypothesis import strategies as st
from serve_utils import ServerProcess, make_served_checkpoint, metric

from kvpage.request import SamplingParams
from kvpage.serve.app import Gateway, ServerConfig
from kvpage.serve.engine_loop import Submission

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

KEYS = ("key-one", "key-two")
MAX_CONNECTIONS = 64
# test_serve.py's engine flags: the same step shapes, so the compilation cache serves both.
SERVER_FLAGS = ("--num_pages=48", "--max_num_seqs=8", "--max_num_batched_tokens=128",
                "--chunk_size=64", "--warmup_sampling=false", "--drain_timeout_s=5",
                f"--api_key={','.join(KEYS)}", f"--max_connections={MAX_CONNECTIONS}",
                "--config.server.header_timeout_s=1", "--config.server.body_timeout_s=1",
                "--config.server.keep_alive_s=2")
AUTH = {"Authorization": f"Bearer {KEYS[1]}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache_dir):
  checkpoint = make_served_checkpoint(tmp_path_factory.mktemp("served"))
  process = ServerProcess(f"--checkpoint={checkpoint}", *SERVER_FLAGS, cache_dir=cache_dir)
  yield process
  assert process.stop() == 0, "".join(process.stderr)
  log = "".join(process.stderr)
  assert "Traceback" not in log and "ERROR" not in log, log


@pytest.fixture(scope="module")
def address(server) -> tuple[str, int]:
  host, port = server.url.removeprefix("http://").split(":")
  return host, int(port)


def _post(server, body, path="/v1/completions", **headers) -> httpx.Response:
  content = body if isinstance(body, bytes) else json.dumps(body)
  return httpx.post(f"{server.url}{path}", content=content, headers={**AUTH, **headers},
                    timeout=30)


def _health_s(server) -> float:
  start = time.perf_counter()
  assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
  return time.perf_counter() - start


def _raw(address, data: bytes, timeout_s: float = 10) -> tuple[bytes, float]:
  """Sends `data` on a fresh connection; what came back before it closed, and when."""
  start = time.monotonic()
  answer = b""
  with socket.create_connection(address, timeout=timeout_s) as connection:
    # The server may answer, and close its side, before all of it was sent.
    with contextlib.suppress(BrokenPipeError):
      connection.sendall(data)
    while part := connection.recv(65536):
      answer += part
  return answer, time.monotonic() - start


def _idle(server) -> str:
  """The metrics text once nothing runs, waits or holds a page (polled)."""
  deadline = time.monotonic() + 30
  while True:
    text = httpx.get(f"{server.url}/metrics").text
    busy = sum(metric(text, f"kvpage:num_requests_{name}") for name in
               ("running", "waiting", "swapped")) + metric(text, "kvpage:kv_cache_usage_perc")
    if busy == 0 or time.monotonic() > deadline:
      return text
    time.sleep(0.05)


# Keys, hosts, origins, media types.
@pytest.mark.parametrize(("headers", "status"), [
    ({}, 401), ({"Authorization": "Bearer nope"}, 401), ({"Authorization": "key-one"}, 401),
    ({"Authorization": "Basic a2V5LW9uZQ=="}, 401), ({"Authorization": "Bearer key-one"}, 200),
    ({"Authorization": "bearer  key-two"}, 200),
])
def test_v1_needs_one_of_the_keys(server, headers, status):
  response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                        headers=headers, timeout=30)
  assert response.status_code == status, response.text
  if status == 401:
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"
  assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == status


def test_the_wait_forecast_is_priced_before_the_first_request(server):
  """Warm-up times every step shape, so the first refusals carry priced hints, not all
  the same default second."""
  timed = [line for line in server.lines if "step shapes for the wait forecast" in line]
  assert timed and int(timed[0].split("timed ")[1].split()[0]) > 0, server.lines


def test_probes_stay_open_and_foreign_hosts_and_origins_are_refused(server, address):
  assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
  assert "kvpage:num_requests_running" in httpx.get(f"{server.url}/metrics").text
  # DNS rebinding: a page served from evil.example reaches 127.0.0.1 under its own name.
  for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
    response = httpx.get(f"{server.url}/health", headers={"Host": host})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_host"
  for host in (f"localhost:{address[1]}", "127.0.0.1", f"[::1]:{address[1]}"):
    assert httpx.get(f"{server.url}/health", headers={"Host": host}).status_code == 200
  # CORS is off: a preflight gets no allow-origin, so a browser keeps other pages out.
  preflight = httpx.options(f"{server.url}/v1/completions", headers={
      "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
  assert "access-control-allow-origin" not in preflight.headers


@pytest.mark.parametrize("content_type", [
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    None])
def test_a_body_not_declared_json_is_415(server, content_type):
  """text/plain is what a browser posts cross-origin without asking (no preflight)."""
  headers = {"Authorization": AUTH["Authorization"]}
  if content_type:
    headers["Content-Type"] = content_type
  response = httpx.post(f"{server.url}/v1/completions", headers=headers,
                        content=json.dumps({"prompt": "hi", "max_tokens": 1}))
  assert response.status_code == 415, response.text
  assert response.json()["error"]["code"] == "unsupported_media_type"
  ok = _post(server, {"prompt": "hi", "max_tokens": 1},
             **{"Content-Type": "application/json; charset=utf-8"})
  assert ok.status_code == 200, ok.text


# Bodies.
@pytest.mark.parametrize(("body", "status", "code"), [
    (b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", 400, "invalid_json"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    (b'{"prompt": {"a": ' * 5000 + b"1" + b"}" * 5001, 400, "invalid_json"),
    (b'{"prompt": "a\\ud800b"}', 400, "invalid_text"),
    (b'{"prompt": "hi", "stop": ["\\udfff"]}', 400, "invalid_text"),
    (b'{"prompt": "hi", "model": "\\ud83d"}', 400, "invalid_text"),
    (b'{"prompt": "\xff\xfe"}', 400, "invalid_json"),
    (b'{"prompt": "hi", "max_tokens": 1e400}', 400, "invalid_value"),
    (b'{"prompt": "hi", "temperature": NaN}', 400, "invalid_value"),
    (b'{"prompt": "hi", "priority": 99999999999999999999}', 400, "invalid_value"),
    (json.dumps({"prompt": "ab " * 200_000}).encode(), 400, "context_length_exceeded"),
    (json.dumps({"prompt": "x" * 1_200_000}).encode(), 413, "body_too_large"),
])
def test_malformed_bodies_are_4xx_and_the_connection_lives(server, address, body, status, code):
  connection = http.client.HTTPConnection(*address, timeout=30)
  connection.request("POST", "/v1/completions", body, AUTH)
  response = connection.getresponse()
  answer = json.loads(response.read())
  assert response.status == status, answer
  assert answer["error"]["code"] == code and answer["error"]["message"]
  alive = connection.sock
  connection.request("GET", "/health")
  assert connection.getresponse().read() == b'{"status":"ok"}'
  assert connection.sock is alive  # the same connection: kept alive after the 4xx


@pytest.mark.parametrize(("body", "code"), [
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "invalid_text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "invalid_text"),
    ({"messages": [{"role": "user", "content": "hi"}] * 600}, "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "x " * 100_000}]}, "context_length_exceeded"),
])
def test_chat_bodies_that_cannot_be_read_or_cannot_fit_are_400(server, body, code):
  # json.dumps writes a lone surrogate as its escape, as a hostile client would.
  response = _post(server, {**body, "max_tokens": 1}, path="/v1/chat/completions")
  assert response.status_code == 400, response.text
  assert response.json()["error"]["code"] == code


def test_health_stays_fast_while_the_largest_prompts_are_refused(server):
  """The largest text the body cap lets through, far past the context: refused by the
  pre-check, never tokenized on the event loop. /health, polled meanwhile, answers
  within 100 ms of its time on a quiet server (a slow machine is slow either way)."""
  quiet = min(_health_s(server) for _ in range(5))
  largest = json.dumps({"prompt": "word " * 200_000, "max_tokens": 1}).encode()
  done = threading.Event()

  def refuse() -> None:
    with httpx.Client(headers=AUTH, timeout=30) as client:
      for _ in range(20):
        response = client.post(f"{server.url}/v1/completions", content=largest)
        assert response.status_code in (400, 413), response.text
    done.set()

  worker = threading.Thread(target=refuse)
  worker.start()
  polls = []
  while not done.is_set():
    polls.append(_health_s(server))
  worker.join()
  assert polls and max(polls) < quiet + 0.1, (quiet, sorted(polls)[-3:])


def test_a_wait_deadline_too_short_to_meet_is_refused_with_a_hint(server):
  response = _post(server, {"prompt": "hi", "max_tokens": 1, "max_queue_wait_s": 1e-9})
  assert response.status_code == 429, response.text
  assert response.json()["error"]["code"] == "wait_deadline"
  milliseconds = int(response.headers["retry-after-ms"])
  assert int(response.headers["retry-after"]) == -(-milliseconds // 1000) >= 1
  assert response.headers["x-should-retry"] == "true"


# Connections.
def test_heads_too_large_too_many_or_too_slow_are_refused_and_closed(server, address):
  huge, _ = _raw(address, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
                 + b"a" * 300_000 + b"\r\n\r\n")
  assert huge.startswith(b"HTTP/1.1 431 ")
  many, _ = _raw(address, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 + b"".join(b"X-%d: 1\r\n" % i for i in range(150)) + b"\r\n")
  assert many.startswith(b"HTTP/1.1 431 ")
  garbage, _ = _raw(address, b"NOT HTTP AT ALL\r\n\r\n")
  assert garbage.startswith(b"HTTP/1.1 400 ")
  slow, seconds = _raw(address, b"GET /health HTTP/1.1\r\nHo")  # and then nothing
  assert slow.startswith(b"HTTP/1.1 408 ") and seconds < 9
  silent, seconds = _raw(address, b"")  # connects, never sends
  assert silent.startswith(b"HTTP/1.1 408 ") and seconds < 9


def test_a_body_shorter_than_its_length_times_out_and_one_dropped_logs_nothing(server, address):
  head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer key-one"
          b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"pro")
  lying, seconds = _raw(address, head)
  assert lying.startswith(b"HTTP/1.1 408 ") and b"body_timeout" in lying and seconds < 9
  before = len(server.stderr)
  for _ in range(20):  # clients that go away mid-body
    with socket.create_connection(address) as connection:
      connection.sendall(head)
  time.sleep(0.5)
  assert _health_s(server) < 30
  assert server.stderr[before:] == []


def test_idle_connections_past_the_cap_make_room_for_a_real_request(server, address):
  """Three times the cap of idle connections: each newcomer closes the one idle longest,
  so a request still gets its answer, and the idle ones are closed, not kept."""
  idle = [socket.create_connection(address) for _ in range(3 * MAX_CONNECTIONS)]
  try:
    response = _post(server, {"prompt": "still served", "max_tokens": 2})
    assert response.status_code == 200, response.text
    closed = 0
    for connection in idle:
      connection.settimeout(5)
      try:
        closed += connection.recv(1) == b""
      except (TimeoutError, ConnectionResetError):
        closed += 1  # the head timeout, or closed with a reset
    assert closed >= 2 * MAX_CONNECTIONS
  finally:
    for connection in idle:
      connection.close()


# The fuzzer.
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4), max_leaves=12)
_TEXT = st.text(min_size=1, max_size=40)
_MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "user", "system", "assistant", "tool"]),
    "content": st.one_of(st.text(max_size=30), st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2))}),
    min_size=1, max_size=3)
# Each field: mostly a value the server takes, sometimes anything JSON can carry.
_VALID = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**32 - 1), "stop": st.lists(st.text(min_size=1, max_size=4),
                                                         max_size=3),
    "stream": st.booleans(), "priority": st.integers(-5, 5), "ignore_eos": st.booleans(),
    "max_queue_wait_s": st.floats(0.001, 100), "user": st.text(max_size=10),
    "return_token_ids": st.booleans(), "n": st.just(1), "logprobs": st.none(),
    "stream_options": st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans(), "include_status": st.booleans()}),
}
_HEADER_VALUE = st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=40)
_HEADERS = st.dictionaries(st.sampled_from(
    ["x-request-id", "x-kvpage-max-wait-s", "Accept", "X-Other", "Content-Encoding",
     "Expect", "Origin", "Cookie"]), _HEADER_VALUE, max_size=3)


def _fuzzed_body(chat: bool) -> st.SearchStrategy:
  first = ({"messages": st.one_of(_MESSAGES, _MESSAGES, _JSON)} if chat else
           {"prompt": st.one_of(_TEXT, st.lists(st.integers(-3, 600), min_size=1, max_size=12),
                                _JSON)})
  fields = {name: st.one_of(valid, valid, valid, _JSON) for name, valid in _VALID.items()}
  return st.one_of(*[st.fixed_dictionaries(
      {**first, "max_tokens": st.one_of(st.integers(1, 3), st.integers(1, 3), _JSON)},
      optional={**fields, "extra_field": _JSON})] * 4, st.binary(max_size=64))


@hypothesis.settings(max_examples=150, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(chat=st.booleans(), data=st.data(), headers=_HEADERS)
def test_fuzzed_bodies_and_headers_never_get_a_5xx(server, address, chat, data, headers):
  path = "/v1/chat/completions" if chat else "/v1/completions"
  body = data.draw(_fuzzed_body(chat))
  if isinstance(body, dict) and isinstance(body["max_tokens"], int) and body["max_tokens"] > 3:
    body["max_tokens"] = 3  # a valid request runs: keep it short
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  connection = http.client.HTTPConnection(*address, timeout=60)
  try:
    connection.request("POST", path, content, {**AUTH, **headers})
    response = connection.getresponse()
    response.read()
    hypothesis.event(f"HTTP {response.status}")
    assert response.status < 500, (response.status, content[:200], headers)
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200
  finally:
    connection.close()


def test_after_all_that_no_page_is_held(server):
  text = _idle(server)
  assert metric(text, "kvpage:kv_cache_usage_perc") == 0
  assert metric(text, "kvpage:num_requests_running") == 0
  log = "".join(server.stderr)
  assert "Traceback" not in log, log


# 10,000 idle connections, on a server that starts in seconds (the simulated GPU).
IDLE_CONNECTIONS = 10_000


def test_ten_thousand_idle_connections_leave_room_for_a_request(cache_dir):
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  wanted = IDLE_CONNECTIONS + 512
  if soft < wanted:
    if hard != resource.RLIM_INFINITY and hard < wanted:
      pytest.skip(f"this process may open {hard} files, fewer than {wanted}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
  server = ServerProcess("--executor=sim", "--config=configs/llama_13b.py",
                         "--hardware=a100_80gb", "--config.server.header_timeout_s=60",
                         cache_dir=cache_dir)
  idle: list[socket.socket] = []
  try:
    host, port = server.url.removeprefix("http://").split(":")
    pid = server.process.pid
    before = _resident_bytes(pid)
    idle = [socket.create_connection((host, int(port))) for _ in range(IDLE_CONNECTIONS)]
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
    assert response.status_code == 200, response.text
    files = len(list(pathlib.Path(f"/proc/{pid}/fd").iterdir()))
    limit = resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]
    assert IDLE_CONNECTIONS <= files < limit
    # Each idle connection costs the server a socket and a parser: tens of kilobytes.
    assert _resident_bytes(pid) - before < 100_000 * IDLE_CONNECTIONS
  finally:
    for connection in idle:
      connection.close()
    assert server.stop() == 0, "".join(server.stderr)
  assert "Traceback" not in "".join(server.stderr)


def _resident_bytes(pid: int) -> int:
  status = pathlib.Path(f"/proc/{pid}/status").read_text()
  return int(next(line.split()[1] for line in status.splitlines()
                  if line.startswith("VmRSS:"))) * 1024


# Drains, in process: the engine thread and the event loop, watched for exceptions.
@pytest.mark.parametrize("drain_timeout_s", [0.0, 0.1, 2.0])
def test_a_drain_at_any_timeout_ends_streams_without_an_exception(drain_timeout_s, caplog):
  def slow_sample(request_id: str, position: int) -> int:
    time.sleep(0.01)  # 400 tokens: 4 s, past every drain timeout here
    return default_sample(request_id, position)

  engine = fake_engine(num_pages=1024, max_model_len=1024, sample=slow_sample)
  gateway = Gateway(engine, ServerConfig(model_name="fake", max_model_len=1024,
                                         drain_timeout_s=drain_timeout_s))
  failures: list[BaseException] = []
  previous_hook = threading.excepthook
  threading.excepthook = lambda args: failures.append(args.exc_value)

  async def main() -> list[str]:
    asyncio.get_running_loop().set_exception_handler(
        lambda loop, context: failures.append(context.get("exception") or
                                              RuntimeError(context["message"])))
    gateway.start()
    try:
      streams = []
      for index in range(3):
        answer, stream = await gateway.loop.submit(Submission(
            f"r{index}", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True)))
        assert answer.admitted
        streams.append(stream)
      await asyncio.sleep(0.05)
      assert await gateway.drain() == 3
      ends = [(await stream.done).finish_reason for stream in streams]
      await asyncio.sleep(0.2)  # the engine thread's late notices, if any, land here
      return ends
    finally:
      gateway.stop()

  try:
    with caplog.at_level(logging.ERROR):
      ends = asyncio.run(main())
  finally:
    threading.excepthook = previous_hook
  assert ends == ["abort"] * 3
  assert failures == [] and gateway.loop.failure is None
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
  assert engine.scheduler.page_pool.num_used_pages == 0
