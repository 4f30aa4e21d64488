"""Seeded synthetic traffic: distributions, arrival processes, JSONL traces."""

import numpy as np
import pytest

from kvpage.sim import workload


def trace(**overrides):
  args = dict(num_requests=400, arrival_rate=10.0, prompt_len="lognormal:300:4096",
              output_len="uniform:8:64", vocab_size=100, seed=1)
  args.update(overrides)
  return workload.synthesize(**args)


def test_same_seed_same_trace_and_seed_matters():
  assert trace() == trace()
  assert trace() != trace(seed=2)


def test_length_specs_respect_their_ranges():
  rng = np.random.default_rng(0)
  assert set(workload.parse_lengths("7")(rng, 50)) == {7}
  uniform = workload.parse_lengths("uniform:3:9")(rng, 2000)
  assert uniform.min() == 3 and uniform.max() == 9
  lognormal = workload.parse_lengths("lognormal:300:4096")(rng, 20000)
  assert lognormal.min() >= 1 and lognormal.max() <= 4096
  assert 270 < np.median(lognormal) < 330
  mix = workload.parse_lengths("mix:0.1:8000:50")(rng, 20000)
  assert set(mix) == {8000, 50} and abs(np.mean(mix == 8000) - 0.1) < 0.01


@pytest.mark.parametrize("spec,message", [
    ("0", "single positive integer"), ("uniform:9:3", "LO <= HI"), ("uniform:3", "needs 2"),
    ("lognormal:a:5", "non-numeric"), ("mix:1.5:10:5", "FRACTION"), ("zipf:2", "unknown"),
])
def test_bad_length_specs(spec, message):
  with pytest.raises(ValueError, match=message):
    workload.parse_lengths(spec)


def test_arrival_processes():
  rng = np.random.default_rng(0)
  poisson = workload.arrival_times(rng, 5000, 20.0, "poisson")
  assert poisson[0] == 0 and np.all(np.diff(poisson) >= 0)
  assert abs(len(poisson) / poisson[-1] - 20.0) < 1.5  # mean rate
  bursty = np.diff(workload.arrival_times(rng, 5000, 20.0, "gamma:3"))
  assert bursty.std() / bursty.mean() > 2.5  # coefficient of variation ~3
  assert abs(1 / bursty.mean() - 20.0) < 3
  assert not np.any(workload.arrival_times(rng, 10, float("inf"), "poisson"))
  with pytest.raises(ValueError, match="poisson or gamma"):
    workload.arrival_times(rng, 10, 1.0, "uniform")
  with pytest.raises(ValueError, match="must be > 0"):
    workload.arrival_times(rng, 10, 0.0, "poisson")


def test_trace_fields_and_jsonl_round_trip(tmp_path):
  requests = trace(num_requests=20, priority="uniform:0:2")
  assert all(1 <= t < 100 for r in requests for t in r.prompt_ids)
  assert {r.priority for r in requests} <= {0, 1, 2}
  path = tmp_path / "trace.jsonl"
  workload.save_jsonl(requests, path)
  assert workload.load_jsonl(path) == requests
  path.write_text(path.read_text() + '{"request_id": "x"}\n')
  with pytest.raises(ValueError, match=r"trace.jsonl:21: not a trace request"):
    workload.load_jsonl(path)
  summary = workload.summarize(requests)
  assert summary["num_requests"] == 20 and summary["output_len"]["max"] <= 64


@pytest.mark.parametrize("line,message", [
    ('{"request_id": "a", "arrival_time": NaN, "prompt_ids": [1], "output_len": 2}', "finite"),
    ('{"request_id": "a", "arrival_time": -1, "prompt_ids": [1], "output_len": 2}', ">= 0"),
    ('{"request_id": "a", "arrival_time": "0.5", "prompt_ids": [1], "output_len": 2}', "finite"),
    ('{"request_id": "a", "arrival_time": 0, "prompt_ids": [], "output_len": 2}', "non-empty"),
    ('{"request_id": "a", "arrival_time": 0, "prompt_ids": [1], "output_len": 0}', ">= 1"),
    ('{"request_id": "a", "arrival_time": 0, "prompt_ids": [1], "output_len": 2.5}', "integer"),
])
def test_malformed_trace_entries_are_rejected_with_their_line(tmp_path, line, message):
  path = tmp_path / "t.jsonl"
  path.write_text(line + "\n")
  with pytest.raises(ValueError, match=rf"t\.jsonl:1: .*{message}"):
    workload.load_jsonl(path)


def test_empty_and_duplicate_traces_are_rejected(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text("\n")
  with pytest.raises(ValueError, match="empty"):
    workload.load_jsonl(path)
  entry = '{"request_id": "a", "arrival_time": 0, "prompt_ids": [1], "output_len": 2}\n'
  path.write_text(entry * 2)
  with pytest.raises(ValueError, match="'a' appears more than once"):
    workload.load_jsonl(path)


def test_lognormal_takes_a_sigma():
  rng = np.random.default_rng(0)
  narrow = workload.parse_lengths("lognormal:300:100000:0.25")(rng, 20000)
  wide = workload.parse_lengths("lognormal:300:100000:2")(rng, 20000)
  assert 280 < np.median(narrow) < 320 and 250 < np.median(wide) < 350
  # sigma is the standard deviation of log(length)
  assert np.std(np.log(narrow)) == pytest.approx(0.25, rel=0.05)
  assert np.std(np.log(wide)) == pytest.approx(2.0, rel=0.05)
  with pytest.raises(ValueError, match="0 < SIGMA <= 10"):
    workload.parse_lengths("lognormal:300:4096:0")


def test_lengths_replay_in_order_from_a_csv(tmp_path):
  path = tmp_path / "lengths.csv"
  path.write_text("num_prefill_tokens,num_decode_tokens,other\n100,7,x\n3000,250,y\n")
  lengths = workload.load_lengths_csv(path)
  assert lengths == [(100, 7), (3000, 250)]
  trace = workload.synthesize(num_requests=5, arrival_rate=1.0, prompt_len="8",
                              output_len="8", vocab_size=100, seed=0, lengths=lengths)
  assert [(r.prompt_len, r.output_len) for r in trace] == [
      (100, 7), (3000, 250), (100, 7), (3000, 250), (100, 7)]
  (tmp_path / "bad.csv").write_text("prompt_len,output_len\n10,2.5\n")
  with pytest.raises(ValueError, match=r"bad\.csv:2: lengths must be whole numbers"):
    workload.load_lengths_csv(tmp_path / "bad.csv")
  (tmp_path / "none.csv").write_text("a,b\n1,2\n")
  with pytest.raises(ValueError, match="needs a header with prompt_len and output_len"):
    workload.load_lengths_csv(tmp_path / "none.csv")
