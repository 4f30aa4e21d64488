"""Fragmentation arithmetic, the contiguous baseline, and the attention benchmark's smoke run."""

import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import dense_attention, make_case, relative_error

from benchmarks import contiguous
from kvpage.sim import capacity

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_fragmentation_counts_whole_pages_and_max_len_slabs():
  frag = capacity.fragmentation([1, 16, 17, 100], max_len=128, page_size=16,
                                kv_bytes_per_token=10)
  assert frag.used_tokens == 134
  assert frag.paged_reserved_tokens == (1 + 1 + 2 + 7) * 16
  assert frag.contiguous_reserved_tokens == 4 * 128
  assert frag.paged_reserved_bytes == 176 * 10 and frag.used_bytes == 1340
  assert frag.paged_utilization == pytest.approx(134 / 176)
  assert frag.contiguous_waste == pytest.approx(1 - 134 / 512)


def test_fragmentation_rejects_bad_lengths():
  with pytest.raises(ValueError, match="exceeds max_len"):
    capacity.fragmentation([10, 200], max_len=128)
  with pytest.raises(ValueError, match="positive"):
    capacity.fragmentation([0], max_len=128)
  with pytest.raises(ValueError, match="empty"):
    capacity.fragmentation([], max_len=128)


def test_contiguous_decode_matches_dense():
  case = make_case([(40, 1), (17, 1), (1, 1)], num_heads=8, num_kv_heads=2, head_dim=16,
                   page_size=16, seed=5)
  max_len = 48
  k = np.zeros((3, 2, max_len, 16), np.float32)
  v = np.zeros_like(k)
  for s, (keys, values) in enumerate(zip(case.keys, case.values)):
    k[s, :, :len(keys)] = keys.transpose(1, 0, 2)
    v[s, :, :len(values)] = values.transpose(1, 0, 2)
  out = contiguous.decode_attention(jnp.asarray(case.q), jnp.asarray(k), jnp.asarray(v),
                                    jnp.asarray(case.context_lens))
  assert relative_error(np.asarray(out), dense_attention(case)) < 1e-5


def test_attention_benchmark_runs_and_writes_json(tmp_path):
  out = tmp_path / "attention.json"
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.attention_cpu", "--batches=2", "--contexts=40",
       "--repeats=1", "--num_seqs=500", f"--out={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  record = json.loads(out.read_text())
  assert record["decode"][0]["batch"] == 2 and record["decode"][0]["paged_ms"] > 0
  frag = record["fragmentation"]
  assert frag["paged_waste"] < frag["contiguous_waste"]
  assert record["premises"]["model"] == "tiny" and record["premises"]["packages"]["jax"]
