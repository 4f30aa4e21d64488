r"""A bounded load client for any OpenAI-compatible completion server, on this machine.

  python -m benchmarks.serve_http --url=http://127.0.0.1:8000 --num_requests=256 \
      --request_rate=8 --max_concurrency=64 --prompt_len=512 --output_len=128 --label=kvpage

What it measures: `--num_requests` streamed requests arrive as a seeded Poisson process
at `--request_rate` per second (`inf`: all at once), at most `--max_concurrency` in
progress at a time (0: no cap), until all are answered or `--timeout_s` has passed (what
is left then is cancelled and counted as unfinished). Each request is timed from the
client's side of the wire: time to first token (TTFT) from the send of the attempt the
server admitted, and separately from its first attempt (`ttft_incl_retries_s`), the gap
between later content chunks (inter-token latency, ITL), time per output token (TPOT,
(last chunk - first chunk) / (tokens - 1)), and output tokens per second over the run's
wall time. Only served requests enter the latency and throughput figures.

Back-pressure is part of the measurement. A 429 or 503 is a rejection; the client waits
what the server asks — `retry-after-ms` if present, else `Retry-After` (seconds or an
HTTP date) — and retries, at most `--max_retries` times. It gives up on an answer that
says `x-should-retry: false` or asks for more than 120 s; without a hint (or with
`--nohonor_retry_after`, which ignores the timing hints but still obeys
`x-should-retry`) it backs off 0.5 s, doubling. A request waiting to retry keeps its
concurrency slot, as a user would. The report counts rejections by status, the retries
and the share that followed a server hint, the time slept, and how many rejected
requests were served in the end.

Streams are parsed by hand, line by line: `data: {...}` chunks, `data: [DONE]` at the
end, and SSE comments (`: ...`, which a server may send to report progress or to keep
the connection open) counted per request as `status_comments`. A chunk with no choices
and a `status` key is a status chunk, not a token; a chunk with an `error` key fails the
request.

Against another engine: start it on this machine and point `--url` at it, e.g.
`vllm serve MODEL --port 8000`, then this command with `--label=vllm`. The model is the
first id of `GET /v1/models` unless `--model` names one. `/v1/completions` prompts are
lists of `--prompt_len` random token ids in [`--min_token_id`, `--max_token_id`) (the
defaults fit every vocabulary from the tiny model's 512 up); `--endpoint=chat` sends as
many random words as text instead. `"ignore_eos": true` (a vLLM/SGLang extension; turn
it off with `--noignore_eos`) makes every request generate `--output_len` tokens. Only
loopback hosts are accepted: this is a load generator.

Prints a table and writes `--output` (JSON): the premises (URL, model, every setting,
Python and aiohttp versions, host, start time, the server's /v1/models answer), the
summary and one record per request. `benchmarks.load_client` holds the flag-free
core (`run_load`, `summarize`) that tests and other benchmarks call.
"""

import asyncio
import dataclasses
import json
import pathlib

from absl import flags

from benchmarks.load_client import ENDPOINTS, LoadConfig, format_table, run_load, to_record
from experiments import cli

# The entry point: one flag per LoadConfig field, plus where the record goes.
_DEFAULTS = LoadConfig()
flags.DEFINE_string("url", _DEFAULTS.url, "Server base URL; loopback hosts only.")
flags.DEFINE_string("model", None, "Model name (default: the first id of GET /v1/models).")
flags.DEFINE_enum("endpoint", _DEFAULTS.endpoint, list(ENDPOINTS),
                  "/v1/completions (token-id prompts) or /v1/chat/completions (text).")
flags.DEFINE_integer("num_requests", _DEFAULTS.num_requests, "Requests to send.")
flags.DEFINE_float("request_rate", _DEFAULTS.request_rate,
                   "Poisson arrivals per second; inf = all at once.")
flags.DEFINE_integer("max_concurrency", _DEFAULTS.max_concurrency,
                     "Requests in progress at most (a waiting retry keeps its slot); 0 = no cap.")
flags.DEFINE_integer("prompt_len", _DEFAULTS.prompt_len, "Prompt tokens (chat: words).")
flags.DEFINE_integer("output_len", _DEFAULTS.output_len, "max_tokens of each request.")
flags.DEFINE_integer("min_token_id", _DEFAULTS.min_token_id, "Smallest prompt token id.")
flags.DEFINE_integer("max_token_id", _DEFAULTS.max_token_id, "Prompt token ids stay below it.")
flags.DEFINE_bool("ignore_eos", _DEFAULTS.ignore_eos,
                  'Send "ignore_eos": true, so that every request generates output_len tokens.')
flags.DEFINE_float("temperature", _DEFAULTS.temperature, "Sampling temperature; 0 = greedy.")
flags.DEFINE_integer("seed", _DEFAULTS.seed, "Seed of the prompts and the arrivals.")
flags.DEFINE_integer("max_retries", _DEFAULTS.max_retries, "Retries of a 429/503, at most.")
flags.DEFINE_bool("honor_retry_after", _DEFAULTS.honor_retry_after,
                  "Wait the server's retry-after-ms / Retry-After; else back off 0.5 s, doubling.")
flags.DEFINE_bool("include_status", _DEFAULTS.include_status,
                  "Ask for status chunks while a request waits (kvpage's stream option).")
flags.DEFINE_float("max_queue_wait_s", _DEFAULTS.max_queue_wait_s,
                   "kvpage's wait deadline, sent in every body (default: none).")
flags.DEFINE_float("timeout_s", _DEFAULTS.timeout_s,
                   "Wall bound of the load; what is left then is cancelled, counted unfinished.")
_OUTPUT = flags.DEFINE_string("output", "workdir/serve_http/result.json", "JSON record path.")
_LABEL = flags.DEFINE_string("label", "", "Free text stored in the record (the engine, say).")


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = LoadConfig(**{field.name: flags.FLAGS[field.name].value
                         for field in dataclasses.fields(LoadConfig)})
  output = pathlib.Path(_OUTPUT.value)
  with cli.workdir(str(output.parent)) as directory:  # checked writable before the load
    result = asyncio.run(run_load(config))
    record = to_record(result, label=_LABEL.value, output=str(output))
    print(format_table(result, record["summary"]))
    cli.write_files(directory, {output.name: json.dumps(record, indent=2, allow_nan=False)})
  print(f"wrote {output}")


if __name__ == "__main__":
  cli.run(main)
