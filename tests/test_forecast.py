"""The wait forecast's parts: the step-cost model recovers known prices (each kind on
its own, non-negative, compiles left out, a kind without samples borrowed with a
floor and a margin), and the forward run follows the scheduler's rules: ends free
pages on time, the queue joins first come first served as pages allow, prefill runs
in chunks, and reservations are admitted in rank order, never before they are due."""

import pytest

from kvpage.host import forecast
from kvpage.host.step_cost import BORROWED_ERROR, StepCostModel

DECODE = (0.01, 0.0, 1e-5, 0.0)  # launch, per token, per context token, floor
PREFILL = (0.01, 1e-4, 0.0, 0.0)


def test_cost_model_recovers_each_kind_and_skips_compiles():
  model = StepCostModel()
  assert model.predict(64, 1000, prefill=False) is None
  for n in range(8):
    tokens, context = 1 + n % 3, 100 * (n + 1)  # decode steps: one token per sequence
    model.observe(tokens, context, 0.01 + 1e-5 * context, num_sequences=tokens)
    model.observe(512 * (n + 1), 0, 0.01 + 1e-4 * 512 * (n + 1), num_sequences=1)
  assert model.predict(4, 3000, prefill=False) == pytest.approx(0.04)
  assert model.predict(2048, 0, prefill=True) == pytest.approx(0.2148)
  model.observe(512, 0, 30.0, num_sequences=1)  # a compilation, not a step
  assert model.predict(2048, 0, prefill=True) == pytest.approx(0.2148)
  assert all(c >= 0 for c in model.coefficients(True))


def test_a_compile_before_any_forecast_is_left_out_by_the_kinds_own_samples():
  model = StepCostModel()
  for tokens in (64, 128, 256):  # warm-up prices a few prefill shapes; nothing asked yet
    model.observe(tokens, 0, 0.01 + 1e-4 * tokens, num_sequences=1)
  model.observe(128, 0, 4.0, num_sequences=1)  # the first request compiles something
  assert model.predict(256, 0, prefill=True) == pytest.approx((0.01 + 1e-4 * 256)
                                                              * (1 + BORROWED_ERROR))


def test_a_kind_without_samples_borrows_with_a_floor_and_a_margin():
  model = StepCostModel()
  for tokens in (256, 2048, 2048):  # only prefill steps, cost proportional to tokens
    model.observe(tokens, 0, 1e-4 * tokens, num_sequences=8)
  # Priced down the prefill line a 66-sequence decode would cost 6.6 ms; the cheapest
  # step seen (25.6 ms), with the borrowed margin, is the honest lower bound.
  assert model.predict(66, 66_000, prefill=False) == pytest.approx(
      0.0256 * (1 + BORROWED_ERROR))


def rules(**overrides) -> forecast.Rules:
  knobs = dict(max_num_batched_tokens=64, chunk_size=16, max_num_seqs=8, chunked=True,
               page_size=4, watermark_pages=0.0, decode_costs=DECODE, prefill_costs=PREFILL,
               horizon_s=60.0)
  knobs.update(overrides)
  return forecast.Rules(**knobs)


def decoding(rid: str, computed: int, samples_left: int) -> forecast.Job:
  return forecast.Job(rid, 0, samples_left, computed, -(-computed // 4), 0)


def test_a_running_request_frees_its_pages_when_its_last_token_is_sampled():
  timeline = forecast.run(rules(), 10, [decoding("a", 8, 3)], [], [])
  # Three decode steps, attending to 9, 10 and 11 tokens; it grew to 3 pages and frees them.
  assert timeline.times[-1] == pytest.approx(3 * 0.01 + 1e-5 * (9 + 10 + 11))
  assert timeline.rooms[0] == 10 and timeline.rooms[-1] == 10 + 2


def test_the_queue_joins_in_order_as_pages_allow_and_prefills_in_chunks():
  queue = [forecast.Job("w0", 40, 2, 0, 0, 11, waiting=True),
           forecast.Job("w1", 8, 2, 0, 0, 3, waiting=True)]
  # 6 free pages: "a" grows into one, w0's first 16-token chunk takes 4, and w1's
  # 8 tokens (2 pages) wait behind it (FCFS).
  timeline = forecast.run(rules(), 6, [decoding("a", 4, 2)], queue, [])
  assert timeline.scheduled["w0"] == 0.0
  assert timeline.scheduled["w1"] > timeline.scheduled["w0"]
  assert timeline.departures == sorted(timeline.scheduled.values())
  # w0 needs 3 chunks (16 + 16 + 8) before its first token: no end before the third step.
  assert timeline.rooms[-1] == 6 + 1  # everything ended: all pages back
  # Its first token comes at the end of the step that computes its last chunk, the
  # third step from the start; w1's at the end of its only prefill step, later still.
  assert timeline.first_tokens["w0"] == pytest.approx(timeline.times[3])
  assert timeline.first_tokens["w0"] > timeline.scheduled["w0"]
  assert timeline.first_tokens["w1"] > max(timeline.scheduled["w1"], timeline.first_tokens["w0"])


def test_reservations_are_admitted_in_rank_order_and_not_before_due():
  reserved = [forecast.Job("r0", 8, 2, 0, 0, 3, due=0.5), forecast.Job("r1", 8, 2, 0, 0, 3)]
  timeline = forecast.run(rules(), 8, [decoding("a", 8, 100)], [], reserved)
  assert timeline.admitted["r1"] == 0.0  # 8 - 3 (r0's hold) - 3 leaves room for both
  assert timeline.admitted["r0"] >= 0.5
  tight = forecast.run(rules(watermark_pages=3.0), 8, [decoding("a", 8, 100)], [],
                       [forecast.Job("r0", 8, 2, 0, 0, 3, due=0.5),
                        forecast.Job("r1", 8, 2, 0, 0, 3)])
  assert "r1" not in tight.admitted or tight.admitted["r1"] >= tight.admitted["r0"]


def test_a_forecast_made_while_a_step_is_in_flight_starts_when_it_ends():
  """Under async scheduling the requests already count the step in flight: the forecast
  starts when it is back, so every time shifts by it and the pace is unchanged."""
  def queue() -> list[forecast.Job]:  # a fresh one each run: a run consumes its jobs
    return [forecast.Job("w0", 20, 2, 0, 0, 6, waiting=True)]

  now = forecast.run(rules(), 6, [decoding("a", 8, 3)], queue(), [])
  later = forecast.run(rules(), 6, [decoding("a", 8, 3)], queue(), [], start_s=0.5)
  assert later.times[0] == 0.0 and later.rooms == now.rooms
  assert later.times[1:] == pytest.approx([t + 0.5 for t in now.times[1:]])
  assert later.scheduled["w0"] == pytest.approx(now.scheduled["w0"] + 0.5)
  assert later.seconds_per_step == pytest.approx(now.seconds_per_step)


def test_a_forecast_until_a_request_stops_at_its_first_token_and_agrees_with_the_whole():
  def queue() -> list[forecast.Job]:
    return [forecast.Job("w0", 8, 2, 0, 0, 3, waiting=True),
            forecast.Job("w1", 8, 2, 0, 0, 3, waiting=True)]

  whole = forecast.run(rules(), 12, [decoding("a", 8, 50)], queue(), [])
  cut = forecast.run(rules(), 12, [decoding("a", 8, 50)], queue(), [], until="w1")
  assert cut.first_tokens["w1"] == pytest.approx(whole.first_tokens["w1"])
  assert cut.times[-1] == pytest.approx(cut.first_tokens["w1"])  # not a step further
  assert len(cut.times) < len(whole.times) and not cut.ends  # "a" decodes on, unseen
