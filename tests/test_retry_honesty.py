"""The retry hint's honesty, measured as the study measures it, at small scale: the tiny
model on a simulated A100 with a pool of 160 pages, a burst of requests ten times what
it holds, clients that retry exactly when told (same id: reservations on). Most first
retries are admitted and the median hint is close to the wait that was really needed;
with the hint replaced by a fixed guess, the same study fails, so it can tell.

With places held, a hint also shapes the wait it is measured against: the room a
holder ahead was promised idles until that holder returns, so a long hint stretches
the wait the next one really needs. There the ratio cannot tell a fixed guess from the
forecast; the time the burst takes does (the held room idles). Without places held
(reservations off: the ledger shapes hints only), the ratio tells."""

import pytest

from benchmarks import retry_study
from configs import hardware as hardware_lib
from configs import tiny
from kvpage.host import wait_estimate
from kvpage.sim import workload


def study(rate: float, reservations: bool = True) -> dict:
  config = tiny.get_config()
  config.scheduler.retry_reservations = reservations
  config.scheduler.max_retry_after_s = 600.0
  trace = workload.synthesize(num_requests=80, arrival_rate=rate, prompt_len="uniform:16:200",
                              output_len="uniform:16:128", vocab_size=config.model.vocab_size,
                              seed=3)
  return retry_study.measure(config, hardware_lib.get_hardware("a100_80gb"), trace, rate,
                               max_attempts=50, num_pages=160)


@pytest.mark.parametrize("rate", [200.0, 2000.0])
def test_first_retries_are_admitted_and_hints_are_tight(rate):
  row = study(rate)
  assert row["requests_rejected"] >= 20  # the burst really overloads the pool
  assert row["first_retry_admitted"] >= 0.8
  assert 1.0 <= row["median_hint_over_actual"] <= 2.0


def test_a_fixed_hint_fails_the_same_study(monkeypatch):
  honest = study(2000.0)
  monkeypatch.setattr(wait_estimate.WaitEstimator, "_hint",
                      lambda self, seconds, timeline, **_: self.default_s)
  ledger = study(2000.0, reservations=False)
  assert not (ledger["first_retry_admitted"] >= 0.8
              and ledger["median_hint_over_actual"] <= 2.0)
  held = study(2000.0)  # 1 s for everyone, against about 0.25 s forecast
  assert held["duration_s"] > 2 * honest["duration_s"]
