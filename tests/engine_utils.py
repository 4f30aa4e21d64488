"""Helpers shared by the engine tests: a fake executor, engines over it, a streaming loop.

`FakeExecutor` implements the whole `Executor` contract with no model, as JetStream's
mock engine does: synchronous and async (`submit`/`collect`) steps, multi-step
decodes, swap copies and (no-op) warm-up. It plays a deterministic model whose token
after position `p` of a request is `sample(request_id, p)`, so every token a request
receives, every token the host feeds back, and every cached position is checkable.
"""

import zlib
from collections.abc import Callable

from configs import scheduler as scheduler_lib
from kvpage.host.engine import Engine
from kvpage.host.pages import PagePool
from kvpage.host.scheduler import Scheduler
from kvpage.interface import Executor, Samples, ScheduledSequence, SchedulerOutput
from kvpage.request import PLACEHOLDER, Request
from kvpage.units import NULL_PAGE

SampleFn = Callable[[str, int], int]  # (request id, position computed) -> next token


def default_sample(request_id: str, position: int) -> int:
  """A token that depends on the request and the position, like a model's."""
  return (zlib.crc32(request_id.encode()) + 7 * position) % 97


def expected_token(request: Request, position: int, sample: SampleFn) -> int:
  """The token at `position` of `request` under the fake model: prompt, then samples."""
  if position < request.num_prompt_tokens:
    return request.prompt_ids[position]
  return sample(request.request_id, position - 1)


class FakeExecutor(Executor):
  """Device and host KV pages as Python lists, behind the whole `Executor` contract.

  Like a device it runs a step when it is submitted, in submission order: the swap
  copies (swap-outs first), then every scheduled sequence. For each it checks that
  every cached position reads back `(position, token, history)` with the model's
  token and the history of every token up to it (what a position's keys and values
  depend on, so a page shared by prefix caching passes exactly when it is right),
  that every token it is fed is the model's, and writes the computed positions. A
  multi-step decode runs `num_steps` iterations, each fed the previous
  one's sample. A token the host has not learned yet (`PLACEHOLDER`) is read from the
  previous launch's samples, as the jitted step reads its feed.

  It counts tickets (`num_submitted`, `num_collected`, `in_flight`); collecting one
  twice, or one it never issued, fails. `check(output)`, if given, runs at each
  submission, between `schedule()` and the previous step's `update()`.
  """

  def __init__(self, num_pages: int, page_size: int, num_host_pages: int = 0, *,
               sample: SampleFn = default_sample,
               check: Callable[[SchedulerOutput], None] | None = None):
    self.page_size = page_size
    self.device: list[list] = [[None] * page_size for _ in range(num_pages)]
    self.host: list[list] = [[None] * page_size for _ in range(num_host_pages)]
    self.sample = sample
    self.check = check
    self.num_launches = 0  # submitted steps that computed something
    self.num_submitted = 0
    self.num_collected = 0
    self.num_warmups = 0
    self.num_multi_step_launches = 0  # launches of several decode iterations
    self.num_fed_from_device = 0  # placeholders filled from the previous launch
    self._results: dict[int, Samples] = {}  # ticket -> samples, until collected
    self._feed: dict[str, int] = {}  # the last launch's samples: each request's last
    self._histories: dict[tuple[Request, int], int] = {}

  @classmethod
  def for_pool(cls, pool: PagePool, **kwargs) -> "FakeExecutor":
    return cls(pool.num_pages, pool.page_size, pool.num_host_pages, **kwargs)

  @property
  def num_compiles(self) -> int:
    return 0

  @property
  def in_flight(self) -> int:
    """Tickets submitted and not collected yet."""
    return len(self._results)

  def warmup(self, max_num_seqs: int, max_num_batched_tokens: int,
             all_greedy: tuple[bool, ...] = (True,), num_decode_steps: int = 1, *,
             progress=None, logprobs=False) -> int:
    del max_num_seqs, max_num_batched_tokens, all_greedy, num_decode_steps  # Unused.
    del progress, logprobs  # Unused.
    self.num_warmups += 1
    return 0

  def submit(self, output: SchedulerOutput) -> int:
    if self.check is not None:
      self.check(output)
    for device_page, host_page in output.swap_out:  # swap-out copies first...
      self.host[host_page] = list(self.device[device_page])
    for host_page, device_page in output.swap_in:  # ...then swap-in, then the step
      self.device[device_page] = list(self.host[host_page])
    samples: Samples = {}
    for seq in output.scheduled:
      tokens = self._run(seq, self._fed_tokens(seq))
      if seq.samples:
        samples[seq.request_id] = tokens if seq.num_steps > 1 else tokens[0]
    if output.scheduled:
      self.num_launches += 1
      self.num_multi_step_launches += output.num_steps > 1
      self._feed = {request_id: tokens if isinstance(tokens, int) else tokens[-1]
                    for request_id, tokens in samples.items()}
    ticket = self.num_submitted
    self.num_submitted += 1
    self._results[ticket] = samples
    return ticket

  def collect(self, ticket: int) -> Samples:
    assert ticket in self._results, f"ticket {ticket} collected twice or never issued"
    self.num_collected += 1
    return self._results.pop(ticket)

  def _fed_tokens(self, seq: ScheduledSequence) -> list[int]:
    """The sequence's input tokens, placeholders read from the previous launch."""
    tokens = list(seq.token_ids)
    for i, token in enumerate(tokens):
      if token == PLACEHOLDER:
        assert seq.request_id in self._feed, f"{seq.request_id}: a placeholder not in flight"
        tokens[i] = self._feed[seq.request_id]
        self.num_fed_from_device += 1
    return tokens

  def _run(self, seq: ScheduledSequence, fed: list[int]) -> list[int]:
    """Checks the cache and the inputs, writes the computed positions; returns the
    samples of the last position of each iteration."""
    request, start = seq.request, seq.start_position
    positions = range(start, start + len(fed) + seq.num_steps - 1)
    assert NULL_PAGE not in seq.page_ids
    assert len(seq.page_ids) * self.page_size >= positions.stop, "pages too few"
    assert seq.num_steps == 1 or len(fed) == 1, "a multi-step sequence is one decode"
    for position in range(start):  # cached: must read back intact
      assert self._slot(seq, position) == self._cell(request, position), (
          f"{seq.request_id}: position {position} reads {self._slot(seq, position)}")
    samples = []
    for index, position in enumerate(positions):
      token = fed[index] if index < len(fed) else samples[-1]
      assert token == expected_token(request, position, self.sample), (
          f"{seq.request_id} fed {token} at position {position}")
      page = self.device[seq.page_ids[position // self.page_size]]
      page[position % self.page_size] = self._cell(request, position)
      if index >= len(fed) - 1:  # the last prompt token or a decode iteration samples
        samples.append(self.sample(seq.request_id, position))
    return samples

  def _cell(self, request: Request, position: int) -> tuple[int, int, int]:
    """What position `position` of `request` holds: the model's token there and a hash
    of every token up to it."""
    key = (request, position)
    if key not in self._histories:
      for p in range(position + 1):  # iteratively: no recursion on long sequences
        if (request, p) not in self._histories:
          parent = self._histories[(request, p - 1)] if p else 0
          self._histories[(request, p)] = hash(
              (parent, expected_token(request, p, self.sample)))
    return (position, expected_token(request, position, self.sample),
            self._histories[key])

  def _slot(self, seq: ScheduledSequence, position: int):
    return self.device[seq.page_ids[position // self.page_size]][position % self.page_size]


def fake_engine(num_pages: int = 64, page_size: int = 4, num_host_pages: int = 0, *,
                async_scheduling: bool = True, sample: SampleFn = default_sample,
                max_model_len: int = 256, **scheduler) -> Engine:
  """An engine over a `FakeExecutor`: the scheduler config's defaults, `scheduler` on top."""
  config = scheduler_lib.get_scheduler_config()
  config.update(dict(watermark=0.0, **scheduler))
  scheduler_ = Scheduler(config, num_pages=num_pages, page_size=page_size,
                         max_model_len=max_model_len, num_host_pages=num_host_pages,
                         clock=lambda: 0.0)
  executor = FakeExecutor.for_pool(scheduler_.page_pool, sample=sample)
  return Engine(scheduler_, executor, async_scheduling=async_scheduling)


def run_streaming(engine, prompts, sampling):
  """Steps by hand; returns the requests and every RequestOutput, in order."""
  requests = [engine.add_request(p, sampling)[0] for p in prompts]
  outputs = []
  while engine.has_unfinished():
    outputs.extend(engine.step())
  return requests, outputs
