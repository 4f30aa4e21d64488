r"""What the HTTP layer costs: the same engine and workload, in-process and over HTTP.

  python -m benchmarks.http_overhead --num_requests=64 --request_rate=4 --rounds=2

One workload — `--num_requests` requests of `--prompt_len` random token ids each
asking for `--output_len` tokens (greedy, `ignore_eos`), arriving as a seeded Poisson
process at `--request_rate`, below the tiny model's capacity — runs two ways, in
alternating rounds so that drift on a shared machine hits both alike (each round draws
its own prompts and arrivals from `--seed` + round, the same on both sides, so that no
round replays prompts an earlier one left in the prefix cache):

  * **in-process**: replayed straight into an `Engine` built from the config
    (`kvpage.sim.replay`), timed by the scheduler's own events (`MetricsRecorder`):
    TTFT from arrival to the step that sampled the first token, inter-token latency
    (ITL) between the steps that sampled consecutive tokens;
  * **HTTP**: the same prompts at the same moments from `benchmarks.load_client`,
    streamed from `python -m experiments.serve` (same config, flags and seed, so the
    same weights) in a process of its own, timed at the client: TTFT from the send to
    the first content chunk, ITL between chunks.

With `--executor=sim` both runs serve a simulated GPU in real time (the roofline of
`--hardware`, each step slept through), so the host's CPU is free while the "device"
works, as on a GPU machine; with the real model on a CPU the device work *is* host CPU
work, and the gateway's thread competes with it for the engine's core.

The HTTP figures therefore include everything the gateway adds: the request's parse
and checks, the hop to the engine thread and back, SSE framing, the loopback socket,
and the client's own parsing. Reports each round's p50/p99 and the ratio of the HTTP
p50s to the in-process ones (the issue's bound: at most 1.05).

Last, the same load goes to `benchmarks.http_floor`, a bare ASGI app on the engine's
cores that answers every request at once with one chunk: its TTFT is the loopback
socket, both HTTP parsers and both event loops, which any Python front-end pays before
its own code runs. Reported as a share of the in-process TTFT p50, it says how much of
the TTFT ratio is out of any gateway's reach for this workload on this machine. Prints
and writes JSON with the premises (model, dtype, lengths, batch policy, hardware, versions).
"""

import dataclasses
import json
import os

import numpy as np
from absl import flags
from ml_collections import config_flags

from benchmarks.load_client import LoadConfig, arrival_times, make_prompts
from benchmarks.processes import core_split, over_http, start_server
from configs import hardware as hardware_lib
from experiments import cli
from kvpage import build, metrics, premises
from kvpage.request import SamplingParams
from kvpage.sim import replay, workload

_CONFIG = cli.define_config("configs/tiny.py", "Model config (random weights).")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests per round.")
_RATE = flags.DEFINE_float("request_rate", 4.0, "Poisson arrivals per second.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens.")
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 64, "Output tokens.")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "In-process/HTTP pairs, in alternating order.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", None, "Shortcut for --config.cache.num_pages.")
_EXECUTOR = flags.DEFINE_enum("executor", "jax", ["jax", "sim"],
                              "The real model, or a simulated GPU in real time (paced).")
_HARDWARE = flags.DEFINE_string("hardware", None, "Simulated device (default: config's).")
_COMPILATION_CACHE = flags.DEFINE_string("compilation_cache", "workdir/jax_cache",
                                         "Persistent XLA compilation cache ('' = off).")
_PIN = flags.DEFINE_bool("pin", True, "Engine and load client on separate cores (Linux).")
_OUT = flags.DEFINE_string("out", "workdir/http_overhead/result.json", "The JSON record.")
_SCHEDULER_FLAGS = cli.define_scheduler_shortcuts()


def _percentiles(values: list[float]) -> dict[str, float | None]:
  if not values:
    return {"p50": None, "p99": None}
  p50, p99 = np.percentile(values, [50, 99])
  return {"p50": float(p50), "p99": float(p99)}


def in_process(setup: build.ServingSetup, load: LoadConfig) -> dict:
  """The workload replayed into the engine; figures from the scheduler's events."""
  prompts, arrivals = make_prompts(load), arrival_times(load)
  trace = [workload.TraceRequest(f"r{i}", arrival, tuple(prompt), load.output_len)
           for i, (prompt, arrival) in enumerate(zip(prompts, arrivals, strict=True))]
  engine = setup.engine
  recorder = metrics.MetricsRecorder(engine.scheduler, engine.clock)
  engine.on_step = recorder.on_step
  replay.replay(engine, trace, on_submit=recorder.track, make_sampling=lambda item: (
      SamplingParams(max_tokens=item.output_len, ignore_eos=True)))
  rows = [row for row in recorder.request_rows() if row["finish_reason"] == "length"]
  return dict(served=len(rows), ttft_s=_percentiles([row["ttft_s"] for row in rows]),
              itl_s=_percentiles([gap for row in rows for gap in row["itl_s"]]))


def http_floor(load: LoadConfig, engine_cores: set[int] | None,
               client_cores: set[int] | None) -> dict:
  """The same load against `benchmarks.http_floor` (a bare ASGI app answering at once,
  on the engine's cores): TTFT there is the loopback-and-parse cost no gateway of this
  kind avoids."""
  server, url = start_server(["benchmarks.http_floor"], engine_cores)
  try:
    return over_http(dataclasses.replace(load, url=url, model="floor"), client_cores)
  finally:
    server.terminate()
    server.wait(60)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  config = cli.load_config(_CONFIG)
  cli.apply_scheduler_shortcuts(config, _SCHEDULER_FLAGS)
  # The server gets the same config file and flags (config overrides other than the
  # shortcuts do not travel), so it builds the same engine with the same weights.
  config_file = config_flags.get_config_filename(flags.FLAGS["config"])
  hardware = _HARDWARE.value or config.hardware
  if _NUM_PAGES.value is not None:
    config.cache.num_pages = _NUM_PAGES.value
  shared = [f"--config={config_file}", f"--num_pages={config.cache.num_pages}",
            f"--executor={_EXECUTOR.value}", f"--hardware={hardware}",
            f"--compilation_cache={_COMPILATION_CACHE.value}",
            *(f"--{name}={holder.value}" for name, holder in _SCHEDULER_FLAGS.items()
              if holder.value is not None)]
  with cli.workdir(_OUT.value.rsplit("/", 1)[0] if "/" in _OUT.value else ".") as directory:
    engine_cores, client_cores = core_split(_PIN.value)
    if engine_cores is not None:  # before jax starts its threads
      os.sched_setaffinity(0, engine_cores)
    cli.enable_compilation_cache(_COMPILATION_CACHE.value)
    setup = cli.serving_engine(config, executor=_EXECUTOR.value,
                               hardware=hardware_lib.get_hardware(hardware), paced=True)
    scheduler_config = setup.config.scheduler
    setup.engine.executor.warmup(scheduler_config.max_num_seqs,
                                 scheduler_config.max_num_batched_tokens,
                                 num_decode_steps=scheduler_config.num_decode_steps)
    server, url = start_server(
        # The in-process engine holds no serving line, so neither does the server.
        ["experiments.serve", "--port=0", "--warmup_sampling=false", "--ttft_line_s=0",
         *shared], engine_cores)
    try:
      load = LoadConfig(url=url, num_requests=_NUM_REQUESTS.value, request_rate=_RATE.value,
                        prompt_len=_PROMPT_LEN.value, output_len=_OUTPUT_LEN.value,
                        min_token_id=1, max_token_id=setup.config.model.vocab_size,
                        seed=_SEED.value, max_retries=0)
      # A few requests first, so the first round does not pay for the server's first
      # connections and lazily built routes (the in-process engine was warmed above).
      over_http(dataclasses.replace(load, num_requests=8, seed=load.seed + _ROUNDS.value),
                client_cores)
      rounds, first = [], load
      for number in range(_ROUNDS.value):
        # New prompts every round (seed + round), the same on both sides: a prompt seen
        # in an earlier round would hit the prefix cache and skip its prefill.
        load = dataclasses.replace(first, seed=first.seed + number)
        # Alternated, so that drift on a shared machine favours neither side.
        if number % 2:
          http, local = over_http(load, client_cores), in_process(setup, load)
        else:
          local, http = in_process(setup, load), over_http(load, client_cores)
        rounds.append(dict(round=number, seed=load.seed, in_process=local, http=http))
        print(f"round {number}: TTFT p50 {1e3 * local['ttft_s']['p50']:.2f} ms in-process, "
              f"{1e3 * http['ttft_s']['p50']:.2f} ms over HTTP; ITL p50 "
              f"{1e3 * local['itl_s']['p50']:.2f} / {1e3 * http['itl_s']['p50']:.2f} ms",
              flush=True)
    finally:
      server.terminate()
      server.wait(60)
    floor = http_floor(load, engine_cores, client_cores)

    def ratio(figure: str) -> float:
      http = np.median([r["http"][figure]["p50"] for r in rounds])
      local = np.median([r["in_process"][figure]["p50"] for r in rounds])
      return float(http / local)

    # The bare app's first-chunk time as a share of the in-process TTFT p50: the part
    # of the ratio above 1 that no Python HTTP front-end on this machine can remove.
    floor_share = floor["ttft_s"]["p50"] / np.median(
        [r["in_process"]["ttft_s"]["p50"] for r in rounds])
    record = dict(
        rounds=rounds, ttft_p50_ratio=ratio("ttft_s"), itl_p50_ratio=ratio("itl_s"),
        floor=floor, floor_ttft_p50_share=floor_share,
        premises=dict(executor=_EXECUTOR.value, model=setup.config.model.to_dict(),
                      dtype=setup.config.model.dtype,
                      prompt_len=_PROMPT_LEN.value, output_len=_OUTPUT_LEN.value,
                      num_requests=_NUM_REQUESTS.value, request_rate=_RATE.value,
                      arrival_process="poisson", seed=_SEED.value,
                      num_pages=setup.num_pages, page_size=setup.config.cache.page_size,
                      policies=scheduler_config.to_dict(), hardware=setup.hardware_record,
                      engine_cores=sorted(engine_cores or []),
                      client_cores=sorted(client_cores or []),
                      **premises.environment()))
    print(f"\nHTTP / in-process, median over {len(rounds)} rounds: TTFT p50 "
          f"{record['ttft_p50_ratio']:.3f}x, ITL p50 {record['itl_p50_ratio']:.3f}x "
          f"(bound: 1.05)")
    print(f"A bare ASGI app answering at once (benchmarks.http_floor): first chunk after "
          f"{1e3 * floor['ttft_s']['p50']:.2f} ms p50 = {floor_share:.3f} of the in-process "
          f"TTFT p50 (the HTTP floor)")
    name = _OUT.value.rsplit("/", 1)[-1]
    cli.write_files(directory, {name: json.dumps(record, indent=2)})
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
