"""vLLM's request extensions, as clients send them, against a real server process:
`stream_options.continuous_usage_stats`, `min_tokens`, `stop_token_ids`,
`include_stop_str_in_output` (and `skip_special_tokens`, in `test_serve_parts`, as
random weights seldom sample a special token); `"usage": null` on streamed chunks;
`stop_reason`; `created` per request. And a third-party load generator's default
streaming bodies, served with usage in every chunk."""

import json
import time

import pytest
from serve_utils import ServerProcess, make_served_checkpoint

httpx = pytest.importorskip("httpx")

SERVER_FLAGS = ("--num_pages=64", "--max_num_seqs=8", "--max_num_batched_tokens=128",
                "--chunk_size=64", "--warmup_sampling=false")
PROMPT = "The cache holds"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return make_served_checkpoint(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(checkpoint, cache_dir):
  process = ServerProcess(f"--checkpoint={checkpoint}", *SERVER_FLAGS, cache_dir=cache_dir)
  yield process
  assert process.stop() == 0, "".join(process.stderr)


def _post(server, path: str, body: dict) -> httpx.Response:
  return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def _events(response: httpx.Response) -> list[dict]:
  lines = [line[len("data: "):] for line in response.text.splitlines()
           if line.startswith("data: ")]
  assert lines[-1] == "[DONE]"
  return [json.loads(line) for line in lines[:-1]]


def _greedy(server, max_tokens: int = 16, **extra) -> dict:
  answer = _post(server, "/v1/completions", {
      "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
      "return_token_ids": True, **extra})
  assert answer.status_code == 200, answer.text
  return answer.json()


def test_usage_is_null_on_each_chunk_or_so_far_with_continuous_usage_stats(server):
  body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
          "stream": True}
  plain = _events(_post(server, "/v1/completions", {
      **body, "stream_options": {"include_usage": True}}))
  assert all(chunk["usage"] is None for chunk in plain[:-1])
  assert plain[-1]["usage"]["completion_tokens"] == 8 and plain[-1]["choices"] == []
  continuous = _events(_post(server, "/v1/completions", {
      **body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
  counts = [chunk["usage"]["completion_tokens"] for chunk in continuous]
  assert counts == sorted(counts) and counts[-1] == 8 and counts[0] >= 1
  assert all(chunk["usage"]["total_tokens"] == chunk["usage"]["prompt_tokens"] + count
             for chunk, count in zip(continuous, counts, strict=True))
  without = _events(_post(server, "/v1/completions", body))
  assert all("usage" not in chunk for chunk in without)


def test_a_load_generators_default_streaming_bodies_are_served_with_usage_in_every_chunk(
    server):
  # The bodies a benchmark client in the vLLM ecosystem sends by default (its OpenAI
  # backends): streaming, usage requested in every chunk, ignore_eos in extra body.
  options = {"include_usage": True, "continuous_usage_stats": True}
  completion = {"model": None, "prompt": PROMPT, "temperature": 0.0, "max_tokens": 6,
                "logprobs": None, "stream": True, "stream_options": options,
                "ignore_eos": True}
  chat = {"model": None, "messages": [{"role": "user", "content": [
              {"type": "text", "text": "Hello"}]}], "temperature": 0.0,
          "max_completion_tokens": 6, "stream": True, "stream_options": options,
          "ignore_eos": True}
  for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
    response = _post(server, path, {k: v for k, v in body.items() if v is not None})
    assert response.status_code == 200, response.text
    chunks = _events(response)
    assert all(chunk["usage"] is not None for chunk in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_stop_token_ids_stop_with_their_id_as_stop_reason_after_min_tokens(server):
  ids = _greedy(server)["choices"][0]["token_ids"]
  stop = ids[2]
  first = ids.index(stop)  # where greedy decoding first samples it
  stopped = _greedy(server, stop_token_ids=[stop])["choices"][0]
  assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
  assert stopped["token_ids"] == ids[:first + 1]
  # min_tokens: the stop id is never drawn before that many tokens (masked, as vLLM
  # does: greedy takes the next likeliest there), and after them it stops the request.
  held = _greedy(server, stop_token_ids=[stop], min_tokens=first + 2)["choices"][0]
  assert held["token_ids"][:first + 1] == ids[:first] + held["token_ids"][first:first + 1]
  assert stop not in held["token_ids"][:first + 2]
  assert held["finish_reason"] == "length" or (
      held["token_ids"][-1] == stop and len(held["token_ids"]) > first + 2)
  length = _greedy(server)["choices"][0]
  assert length["finish_reason"] == "length" and length["stop_reason"] is None


def test_stop_strings_name_themselves_and_may_stay_in_the_text(server):
  text = _greedy(server)["choices"][0]["text"]
  stop = text[3:6]
  cut = _greedy(server, stop=[stop])["choices"][0]
  kept = _greedy(server, stop=[stop], include_stop_str_in_output=True)["choices"][0]
  at = text.index(stop)
  assert cut["text"] == text[:at] and cut["stop_reason"] == stop
  assert kept["text"] == text[:at + len(stop)] and kept["stop_reason"] == stop
  assert cut["finish_reason"] == kept["finish_reason"] == "stop"
  # Streamed, the last chunk names it too.
  chunks = _events(_post(server, "/v1/completions", {
      "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop],
      "stream": True}))
  assert chunks[-1]["choices"][0]["stop_reason"] == stop
  assert all(chunk["choices"][0]["stop_reason"] is None for chunk in chunks[:-1])


def test_created_is_each_requests_own_time(server):
  before = int(time.time())
  answer = _greedy(server, max_tokens=2)
  assert before <= answer["created"] <= int(time.time()) + 1


@pytest.mark.parametrize("body, param", [
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(17))}, "stop_token_ids"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "continuous_usage_stats"),
])
def test_bad_extension_values_are_400s_that_name_the_field(server, body, param):
  answer = _post(server, "/v1/completions", {"prompt": PROMPT, **body})
  assert answer.status_code == 400, answer.text
  assert answer.json()["error"]["param"] == param


def test_a_prompt_that_fills_the_context_is_refused_in_terms_the_client_sent(server):
  answer = _post(server, "/v1/completions", {"prompt": [5] * 600})  # no max_tokens
  assert answer.status_code == 400, answer.text
  error = answer.json()["error"]
  assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
  assert "max_tokens" not in error["message"] and "600 tokens" in error["message"]


def test_completions_logprobs_in_openais_shape_streamed_as_whole(server):
  body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
          "logprobs": 3, "return_token_ids": True}
  whole = _post(server, "/v1/completions", body).json()["choices"][0]
  scored = whole["logprobs"]
  assert len(scored["tokens"]) == len(scored["token_logprobs"]) == len(whole["token_ids"]) == 6
  assert all(lp <= 0 for lp in scored["token_logprobs"])
  for top, token, lp in zip(scored["top_logprobs"], scored["tokens"], scored["token_logprobs"],
                            strict=True):
    assert token in top and top[token] == lp  # greedy: the sampled token is the likeliest
    # Three likeliest and the sampled token, keyed by text: tokens that decode alike
    # (lone bytes of a multi-byte character) share a key, as in vLLM.
    assert lp == max(top.values()) and 1 <= len(top) <= 4
  assert scored["text_offset"][0] == 0 and scored["text_offset"] == sorted(
      scored["text_offset"])
  chunks = _events(_post(server, "/v1/completions", {**body, "stream": True}))
  streamed = [lp for chunk in chunks if chunk["choices"] and chunk["choices"][0]["logprobs"]
              for lp in chunk["choices"][0]["logprobs"]["token_logprobs"]]
  assert streamed == scored["token_logprobs"]
  plain = _greedy(server, max_tokens=6)["choices"][0]
  assert plain["logprobs"] is None and plain["token_ids"] == whole["token_ids"]


def test_chat_logprobs_and_top_logprobs(server):
  body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
          "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
  answer = _post(server, "/v1/chat/completions", body)
  assert answer.status_code == 200, answer.text
  content = answer.json()["choices"][0]["logprobs"]["content"]
  assert len(content) == 5
  for item in content:
    assert item["logprob"] <= 0 and item["bytes"] == list(item["token"].encode())
    assert len(item["top_logprobs"]) == 2
    assert item["top_logprobs"][0]["logprob"] == item["logprob"]  # greedy
  without_top = _post(server, "/v1/chat/completions", {**body, "top_logprobs": None}).json()
  assert all(item["top_logprobs"] == []
             for item in without_top["choices"][0]["logprobs"]["content"])
  refused = _post(server, "/v1/chat/completions", {**body, "logprobs": False})
  assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"


def test_an_evaluation_harness_scores_a_continuation_by_echo(server, checkpoint):
  # lm-evaluation-harness's `local-completions` log-likelihood request: the context and
  # the continuation as one prompt of token ids, echoed with logprobs (max_tokens 1 or
  # 0); it sums the continuation's token_logprobs and checks each is the top one.
  from transformers import AutoTokenizer

  context = AutoTokenizer.from_pretrained(str(checkpoint)).encode(PROMPT)
  generated = _post(server, "/v1/completions", {
      "prompt": context, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 1,
      "return_token_ids": True}).json()["choices"][0]
  prompt = context + generated["token_ids"]
  for max_tokens in (1, 0):
    answer = _post(server, "/v1/completions", {
        "prompt": [prompt], "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
        "echo": True, "seed": 1234})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    scored = choice["logprobs"]
    assert len(scored["tokens"]) == len(prompt) + max_tokens
    assert scored["token_logprobs"][0] is None and scored["top_logprobs"][0] is None
    continuation = scored["token_logprobs"][len(context):len(prompt)]
    # The same logits scored the continuation when it was generated: the same numbers.
    assert continuation == pytest.approx(generated["logprobs"]["token_logprobs"], abs=1e-4)
    for logprob, top in zip(continuation, scored["top_logprobs"][len(context):len(prompt)],
                            strict=True):
      assert logprob == pytest.approx(max(top.values()), abs=1e-6)  # greedy continuation
    if max_tokens == 0:  # the prompt scored, nothing generated
      assert answer.json()["usage"]["completion_tokens"] == 0
      assert choice["finish_reason"] == "length"
  streamed = _events(_post(server, "/v1/completions", {
      "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0, "stream": True}))
  assert streamed[0]["choices"][0]["text"] == PROMPT
  assert len(streamed[0]["choices"][0]["logprobs"]["tokens"]) == len(context)
  assert "".join(chunk["choices"][0]["text"] for chunk in streamed) == PROMPT
  refused = _post(server, "/v1/chat/completions", {
      "messages": [{"role": "user", "content": "Hi"}], "echo": True})
  assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"


def _prefix_hits(server) -> float:
  from serve_utils import metric

  return metric(httpx.get(f"{server.url}/metrics").text, "kvpage:prefix_cache_hits_total")


def test_n_choices_share_the_prompts_pages_and_draw_their_own_samples(server):
  prompt = list(range(3, 3 + 40))  # two full pages of 16 and a partial one
  body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 3,
          "ignore_eos": True, "return_token_ids": True}
  hits = _prefix_hits(server)
  answer = _post(server, "/v1/completions", body).json()
  choices = answer["choices"]
  assert [c["index"] for c in choices] == [0, 1, 2]
  assert len({tuple(c["token_ids"]) for c in choices}) > 1  # seeds 5, 6, 7
  assert answer["usage"] == {"prompt_tokens": 40, "completion_tokens": 18,
                             "total_tokens": 58}
  # The second and third read the first's two full pages from the cache.
  assert _prefix_hits(server) - hits >= 2 * 32
  again = _post(server, "/v1/completions", body).json()["choices"]
  assert [c["token_ids"] for c in again] == [c["token_ids"] for c in choices]
  chunks = _events(_post(server, "/v1/completions", {
      **body, "stream": True, "stream_options": {"include_usage": True}}))
  streamed = {0: [], 1: [], 2: []}
  for chunk in chunks[:-1]:
    for choice in chunk["choices"]:
      streamed[choice["index"]] += choice.get("token_ids", [])
  assert [streamed[i] for i in range(3)] == [c["token_ids"] for c in choices]
  assert chunks[-1]["usage"]["completion_tokens"] == 18
  refused = _post(server, "/v1/completions", {**body, "n": 17})
  assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
