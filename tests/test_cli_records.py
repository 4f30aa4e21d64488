"""What a run leaves behind: a whole workdir or none of its files, and a record that
names the limits it ran under and the requests that failed."""

import json
import os

import pytest
from cli_harness import Worker

from experiments import cli
from kvpage import metrics, premises


def test_write_files_is_all_or_nothing(tmp_path):
  cli.write_files(tmp_path, {"a.json": "1", "b.json": "2"})
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]

  target = tmp_path / "second"
  target.mkdir()
  with pytest.raises(TypeError):  # the second file's write fails, after the first's
    cli.write_files(target, {"c.json": "3", "d.json": None})  # type: ignore[dict-item]
  assert list(target.iterdir()) == []  # neither c.json nor a temporary file


def test_workdir_removes_only_what_it_created(tmp_path):
  with pytest.raises(ValueError), cli.workdir(str(tmp_path / "new" / "deeper")):
    raise ValueError("bad input found after the workdir check")
  assert list(tmp_path.iterdir()) == []
  existing = tmp_path / "kept"
  existing.mkdir()
  with pytest.raises(ValueError), cli.workdir(str(existing)):
    raise ValueError("bad input")
  assert existing.is_dir()
  with cli.workdir(str(tmp_path / "ok")) as directory:
    (directory / "file").write_text("x")
  assert (tmp_path / "ok" / "file").exists()


def test_premises_carry_limits_and_jax_settings(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  record = premises.environment()
  assert record["jax_settings"]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
  assert record["jax_settings"]["JAX_PLATFORMS"] == "cpu"
  assert record["cpu_threads"] == len(os.sched_getaffinity(0))
  limit = record["memory_limit"]
  assert set(limit) == {"bytes", "source"}
  assert (limit["bytes"] is None) == (limit["source"] is None)
  json.dumps(record)


def test_failed_requests_are_listed_with_reasons_and_bounded():
  rows = [dict(request_id=f"r{i}", status="rejected", rejected_status=503,
               reject_reason="no pages", finish_reason=None) for i in range(150)]
  rows += [dict(request_id="ok", status="finished", finish_reason="length"),
           dict(request_id="gone", status="finished", finish_reason="aborted"),
           dict(request_id="late", status="waiting", finish_reason=None)]
  failed = metrics.failed_requests(rows, limit=100)
  assert failed["num_failed"] == 152
  assert failed["by_reason"] == {"rejected 503": 150, "aborted": 1, "unfinished (waiting)": 1}
  assert len(failed["first"]) == 100
  assert failed["first"][0] == dict(request_id="r0", reason="rejected 503", detail="no pages")


def test_a_run_writes_its_whole_workdir_and_lists_its_failures(tmp_path):
  worker = Worker("serve_bench")
  try:
    # A pool of 7 usable pages of 16 tokens: 200-token prompts can never fit (400).
    argv = ["--config=configs/tiny.py", "--executor=sim", "--num_requests=12",
            "--prompt_len=mix:0.5:200:8", "--output_len=4", "--num_pages=8",
            f"--workdir={tmp_path}/run"]
    rc, stderr = worker.run(argv)
    assert rc == 0, stderr
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["requests.jsonl", "steps.jsonl", "summary.json", "trace.jsonl"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    failed = summary["failed_requests"]
    assert failed["num_failed"] == summary["rejections"]["400"] > 0
    assert all(item["reason"] == "rejected 400" and item["detail"] for item in failed["first"])
    assert "memory_limit" in summary["premises"] and "jax_settings" in summary["premises"]
  finally:
    worker.close()
