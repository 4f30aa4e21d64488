r"""What the Ray Serve hop costs: one engine in the server's process, against a fleet.

  python -m benchmarks.fleet_http --rounds=3 --out=fleet_http.json

The same load from `benchmarks.load_client` (`--num_requests` streamed requests of
`--prompt_len` random token ids asking for `--output_len` tokens, greedy, `ignore_eos`,
seeded Poisson arrivals at `--request_rate`, below one engine's capacity) goes to
`python -m experiments.serve` three ways, in alternating rounds so that drift on a
shared machine hits each alike:

  * **single**: one engine stepped by a thread of the server's process;
  * **fleet x1**: the same engine in one Ray Serve replica process behind the fleet's
    door (`--replicas=1`): the difference from `single` is the hop (an admission call,
    then the deltas streamed back in batches over Ray);
  * **fleet x2**: two replicas (`--replicas=2`), routed by `kv_headroom`: twice the
    capacity for the same load.

Every server simulates its GPU in real time (`--executor=sim`: each step of the
`--config` model on `--hardware`, priced by its step model, slept through), so the
host's CPU is free while the "device" works, as on a GPU machine. Each starts once and
serves every round (its warm-up and Ray's start are not timed). Figures are the
client's: TTFT from the send to the first content chunk, inter-token latency (ITL)
between chunks. Reports each contender's p50/p99 per round and the ratio of the fleet
x1 p50s to the single ones. Prints a table and writes JSON with the premises (model,
dtype, lengths, batch policy, hardware, versions).
"""

import dataclasses
import json
import pathlib
import subprocess

import numpy as np
from absl import flags

from benchmarks.load_client import LoadConfig
from benchmarks.processes import core_split, over_http, start_server
from experiments import cli
from kvpage import premises

_CONFIG = flags.DEFINE_string("config", "configs/llama_13b.py", "Model config file.")
_HARDWARE = flags.DEFINE_string("hardware", "a100_80gb", "Simulated device.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests per round.")
_RATE = flags.DEFINE_float("request_rate", 4.0, "Poisson arrivals per second.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 256, "Prompt tokens.")
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 64, "Output tokens.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds; each runs every contender once.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")
_OUT = flags.DEFINE_string("out", "workdir/fleet_http/result.json", "The JSON record.")
CONTENDERS = {"single": [], "fleet x1": ["--replicas=1"], "fleet x2": ["--replicas=2"]}


def main(argv: list[str]) -> None:
  del argv  # Unused.
  if _ROUNDS.value < 1 or _NUM_REQUESTS.value < 1:
    raise ValueError("--rounds and --num_requests must be >= 1")
  shared = ["experiments.serve", "--port=0", "--executor=sim", f"--config={_CONFIG.value}",
            f"--hardware={_HARDWARE.value}", "--ttft_line_s=0", "--drain_timeout_s=5"]
  with cli.workdir(str(pathlib.Path(_OUT.value).parent)) as directory:
    server_cores, client_cores = core_split()
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
      for name, extra in CONTENDERS.items():
        servers[name] = start_server([*shared, *extra, "--ray_cpus=2"] if extra
                                     else shared, server_cores)
      load = LoadConfig(num_requests=_NUM_REQUESTS.value, request_rate=_RATE.value,
                        prompt_len=_PROMPT_LEN.value, output_len=_OUTPUT_LEN.value,
                        min_token_id=1, max_token_id=32000, seed=_SEED.value,
                        max_retries=0)
      for _, url in servers.values():  # first connections and lazily built routes
        over_http(dataclasses.replace(load, url=url, num_requests=8, seed=load.seed + 999),
                  client_cores)
      rounds: list[dict] = []
      for number in range(_ROUNDS.value):
        order = list(servers) if number % 2 == 0 else list(reversed(servers))
        row = {}
        for name in order:
          # New prompts every round, the same for every contender.
          row[name] = over_http(dataclasses.replace(load, url=servers[name][1],
                                                    seed=load.seed + number), client_cores)
        rounds.append(row)
        print(f"round {number + 1}: " + "; ".join(
            f"{name} TTFT p50 {1e3 * row[name]['ttft_s']['p50']:.1f} ms, ITL p50 "
            f"{1e3 * row[name]['itl_s']['p50']:.1f} ms" for name in servers), flush=True)
    finally:
      for process, _ in servers.values():
        process.terminate()
      for process, _ in servers.values():
        process.wait(120)
    ratios = {key: float(np.median([r["fleet x1"][key]["p50"] / r["single"][key]["p50"]
                                    for r in rounds])) for key in ("ttft_s", "itl_s")}
    print(f"\n{'contender':<10} {'served':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8}   (median over {len(rounds)} rounds)")
    for name in CONTENDERS:
      med = lambda key, q, name=name: 1e3 * float(np.median([r[name][key][q] for r in rounds]))
      served = int(np.median([r[name]["served"] for r in rounds]))
      print(f"{name:<10} {served:>7} {med('ttft_s', 'p50'):>7.1f}ms {med('ttft_s', 'p99'):>7.1f}ms "
            f"{med('itl_s', 'p50'):>6.1f}ms {med('itl_s', 'p99'):>6.1f}ms")
    print(f"fleet x1 / single, p50: TTFT {ratios['ttft_s']:.3f}, ITL {ratios['itl_s']:.3f}")
    record = dict(
        premises=dict(config=_CONFIG.value, hardware=f"{_HARDWARE.value} (simulated, paced)",
                      dtype="the config's", num_requests=_NUM_REQUESTS.value,
                      request_rate=_RATE.value, prompt_len=_PROMPT_LEN.value,
                      output_len=_OUTPUT_LEN.value, seed=_SEED.value, rounds=_ROUNDS.value,
                      batch_policy="the config's scheduler section; no serving line "
                                   "(--ttft_line_s=0); fleets routed by kv_headroom",
                      cores=dict(servers=sorted(server_cores or []),
                                 client=sorted(client_cores or [])),
                      environment=premises.environment()),
        rounds=rounds, fleet_x1_over_single_p50=ratios)
    out = pathlib.Path(_OUT.value)
    cli.write_files(directory, {out.name: json.dumps(record, indent=2)})
  print(f"wrote {out}")


if __name__ == "__main__":
  cli.run(main)
