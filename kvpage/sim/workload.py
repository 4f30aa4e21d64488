"""Seeded synthetic traffic: arrival processes, length distributions, JSONL traces.

QPS hides what fills the KV cache: one 8,000-token prompt weighs as much as a hundred
50-token ones. A workload here is therefore a list of requests with explicit prompt
and output lengths, arriving on a seeded clock:

  * arrivals: `poisson` (exponential gaps at `rate` requests/s) or `gamma:CV`
    (bursty: gamma gaps with the same mean and coefficient of variation CV > 1);
    `rate = inf` submits everything at t = 0;
  * lengths, as spec strings: `N` (fixed), `uniform:LO:HI`, `lognormal:MEDIAN:MAX`
    (sigma 1, capped), `mix:FRACTION:LONG:SHORT` (e.g. `mix:0.1:8000:50`: 10% long);
  * priorities: `N` or `uniform:LO:HI` (lower value = more important).

Traces save and load as JSONL (one request per line), so a run can be replayed
exactly. Pure Python + numpy.
"""

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Sequence

import numpy as np

Sampler = Callable[[np.random.Generator, int], np.ndarray]


@dataclasses.dataclass(frozen=True)
class TraceRequest:
  """One request of a workload: when it arrives, what it asks for."""

  request_id: str
  arrival_time: float
  prompt_ids: tuple[int, ...]
  output_len: int
  priority: int = 0

  def __post_init__(self):
    if not isinstance(self.arrival_time, (int, float)) or not (
        math.isfinite(self.arrival_time) and self.arrival_time >= 0):
      raise ValueError(f"{self.request_id}: arrival_time must be a finite number of seconds "
                       f">= 0, got {self.arrival_time!r}")
    if not self.prompt_ids or not all(isinstance(t, int) for t in self.prompt_ids):
      raise ValueError(f"{self.request_id}: prompt_ids must be a non-empty list of integers")
    for name in ("output_len", "priority"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{self.request_id}: {name} must be an integer, got {value!r}")
    if self.output_len < 1:
      raise ValueError(f"{self.request_id}: output_len must be >= 1, got {self.output_len}")

  @property
  def prompt_len(self) -> int:
    return len(self.prompt_ids)


def _numbers(spec: str, fields: Sequence[str], what: str = "length") -> list[float]:
  parts = spec.split(":")[1:]
  if len(parts) != len(fields):
    raise ValueError(f"{what} spec {spec!r} needs {len(fields)} values: "
                     f"{spec.split(':')[0]}:{':'.join(f.upper() for f in fields)}")
  try:
    return [float(part) for part in parts]
  except ValueError:
    raise ValueError(f"{what} spec {spec!r} has a non-numeric value") from None


def parse_lengths(spec: str) -> Sampler:
  """A sampler of positive integer lengths from a spec string (see module docstring)."""
  kind = spec.split(":")[0]
  if kind.isdigit():
    value = int(kind)
    if value <= 0 or ":" in spec:
      raise ValueError(f"fixed length spec {spec!r} must be a single positive integer")
    return lambda rng, n: np.full(n, value)
  if kind == "uniform":
    low, high = _numbers(spec, ("lo", "hi"))
    if not 1 <= low <= high:
      raise ValueError(f"uniform spec {spec!r} needs 1 <= LO <= HI")
    return lambda rng, n: rng.integers(int(low), int(high) + 1, n)
  if kind == "lognormal":
    median, cap = _numbers(spec, ("median", "max"))
    if not 1 <= median <= cap:
      raise ValueError(f"lognormal spec {spec!r} needs 1 <= MEDIAN <= MAX")
    return lambda rng, n: np.clip(np.round(rng.lognormal(math.log(median), 1.0, n)), 1, cap)
  if kind == "mix":
    fraction, long, short = _numbers(spec, ("fraction", "long", "short"))
    if not (0 <= fraction <= 1 and long >= 1 and short >= 1):
      raise ValueError(f"mix spec {spec!r} needs 0 <= FRACTION <= 1 and positive lengths")
    return lambda rng, n: np.where(rng.random(n) < fraction, int(long), int(short))
  raise ValueError(f"unknown length spec {spec!r}; use N, uniform:LO:HI, lognormal:MEDIAN:MAX "
                   "or mix:FRACTION:LONG:SHORT")


def parse_priorities(spec: str) -> Sampler:
  """`N` (everyone N) or `uniform:LO:HI` (integers, inclusive)."""
  if spec.lstrip("-").isdigit():
    return lambda rng, n: np.full(n, int(spec))
  if spec.startswith("uniform:"):
    low, high = _numbers(spec, ("lo", "hi"), "priority")
    if low > high:
      raise ValueError(f"priority spec {spec!r} needs LO <= HI")
    return lambda rng, n: rng.integers(int(low), int(high) + 1, n)
  raise ValueError(f"unknown priority spec {spec!r}; use N or uniform:LO:HI")


def arrival_times(rng: np.random.Generator, num: int, rate: float, process: str) -> np.ndarray:
  """Arrival times (s) of `num` requests at `rate` requests/s; `inf` = all at t = 0."""
  if not rate > 0:
    raise ValueError(f"arrival rate must be > 0 requests/s (or inf), got {rate}")
  if math.isinf(rate):
    return np.zeros(num)
  if process == "poisson":
    gaps = rng.exponential(1.0 / rate, num)
  elif process.startswith("gamma:"):
    cv = _numbers(process, ("cv",), "arrival process")[0]
    if cv <= 0:
      raise ValueError(f"gamma arrivals need CV > 0, got {process!r}")
    shape = 1.0 / cv**2  # mean = shape * scale = 1 / rate; CV = 1 / sqrt(shape)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), num)
  else:
    raise ValueError(f"unknown arrival process {process!r}; use poisson or gamma:CV")
  return np.cumsum(gaps) - gaps[0]  # the first request arrives at t = 0


def synthesize(*, num_requests: int, arrival_rate: float, prompt_len: str, output_len: str,
               vocab_size: int, seed: int, arrival_process: str = "poisson",
               priority: str = "0") -> list[TraceRequest]:
  """A seeded workload; the same arguments always give the same trace."""
  if num_requests <= 0:
    raise ValueError(f"num_requests must be > 0, got {num_requests}")
  if vocab_size < 2:
    raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
  rng = np.random.default_rng(seed)
  times = arrival_times(rng, num_requests, arrival_rate, arrival_process)
  prompts = parse_lengths(prompt_len)(rng, num_requests).astype(int)
  outputs = parse_lengths(output_len)(rng, num_requests).astype(int)
  priorities = parse_priorities(priority)(rng, num_requests).astype(int)
  return [TraceRequest(f"req-{i}", float(times[i]),
                       tuple(rng.integers(1, vocab_size, prompts[i]).tolist()),
                       int(outputs[i]), int(priorities[i])) for i in range(num_requests)]


def save_jsonl(trace: Sequence[TraceRequest], path: str | pathlib.Path) -> None:
  with open(path, "w") as f:
    for request in trace:
      f.write(json.dumps(dataclasses.asdict(request)) + "\n")


def load_jsonl(path: str | pathlib.Path) -> list[TraceRequest]:
  """Reads a trace written by `save_jsonl`; names the line of any malformed entry."""
  trace = []
  with open(path) as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        fields = json.loads(line)
        fields["prompt_ids"] = tuple(fields["prompt_ids"])
        trace.append(TraceRequest(**fields))
      except (json.JSONDecodeError, TypeError, KeyError, ValueError) as error:
        raise ValueError(f"{path}:{number}: not a trace request ({error})") from None
  if not trace:
    raise ValueError(f"{path}: the trace is empty")
  ids = [request.request_id for request in trace]
  if len(set(ids)) != len(ids):
    duplicate = next(i for i in ids if ids.count(i) > 1)
    raise ValueError(f"{path}: request_id {duplicate!r} appears more than once")
  return trace


def summarize(trace: Sequence[TraceRequest]) -> dict:
  """Input ranges of a trace, for the premises record."""
  def stats(values):
    values = np.asarray(values)
    return dict(min=int(values.min()), p50=float(np.median(values)),
                mean=float(values.mean()), max=int(values.max()))
  times = [r.arrival_time for r in trace]
  return dict(num_requests=len(trace), duration_s=max(times) - min(times),
              prompt_len=stats([r.prompt_len for r in trace]),
              output_len=stats([r.output_len for r in trace]),
              priority=stats([r.priority for r in trace]))
