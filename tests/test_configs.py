"""Configs load with their variants and read dimensions from the one table."""

import ml_collections
import pytest

from configs import base, llama3_8b, llama_13b, small, tiny
from configs import hardware as hardware_lib
from kvpage import model_shape, sizing
from models import llama


def test_llama_13b_matches_the_llama2_paper():
  model = llama_13b.get_config().model
  assert (model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim) == (
      40, 40, 40, 128)
  assert (model.d_model, model.ffn_dim, model.vocab_size, model.dtype) == (
      5120, 13824, 32000, "fp16")


def test_llama3_8b_is_gqa_bf16():
  model = llama3_8b.get_config().model
  assert (model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim) == (
      32, 32, 8, 128)
  assert (model.d_model, model.ffn_dim, model.vocab_size, model.dtype) == (
      4096, 14336, 128256, "bf16")


@pytest.mark.parametrize("module", [llama_13b, llama3_8b, small, tiny])
@pytest.mark.parametrize("variant", base.DTYPES)
def test_dtype_variants(module, variant):
  config = module.get_config(variant)
  assert config.model.dtype == variant and config.cache.kv_dtype == variant
  assert config.hardware in hardware_lib.HARDWARE
  assert config.model.num_heads % config.model.num_kv_heads == 0


def test_small_is_tens_of_millions_of_parameters_with_gqa():
  model = small.get_config().model
  parameters = model_shape.weight_bytes(model_shape.ModelShape.from_config(model), "fp32") // 4
  assert 20e6 < parameters < 40e6 and model.num_heads == 4 * model.num_kv_heads
  assert small.get_config().cache.num_pages == 0  # its pool: the byte budget


def test_unknown_variant_is_rejected():
  with pytest.raises(ValueError, match="unknown config variant 'fp9'"):
    tiny.get_config("fp9")


def test_hardware_table_cites_sources():
  assert {"a100_40gb", "a100_80gb", "h100_80gb", "h200_141gb", "cpu"} <= set(
      hardware_lib.HARDWARE)
  for spec in hardware_lib.HARDWARE.values():
    assert spec.memory_bytes > 0 and spec.hbm_bandwidth > 0 and spec.peak_flops > 0
    assert spec.source and 0 < spec.compute_efficiency <= 1
    assert 0 < spec.bandwidth_efficiency <= 1
  assert hardware_lib.get_hardware("a100_80gb").memory_bytes == 80 * 2**30


def test_a_real_runs_pool_comes_from_one_byte_budget():
  config = tiny.get_config()
  page = 2 * 4 * 4 * 2 * 64 * 16  # K and V, fp32, 4 layers, 2 KV heads, head_dim 64, 16 tokens
  # A page count, the config's own (or set by --num_pages), decides first.
  assert sizing.real_pool_pages(llama, config, config.model)[:2] == (256, "cache.num_pages=256")
  # Without one: the byte budget.
  config.cache.num_pages = 0
  pages, reason, plan = sizing.real_pool_pages(llama, config, config.model)
  # ... capped at what the scheduler can fill: 64 sequences of 2,048 tokens.
  usable = 64 * 2048 // 16 + 1
  assert pages == usable < 4 * 2**30 // page and "cache.kv_memory_gib=4 GiB" in reason
  assert "capped at what max_num_seqs=64 sequences of 2,048 tokens fill" in reason
  assert plan is None
  config.cache.fit_pool = False  # the budget as given
  pages, reason, plan = sizing.real_pool_pages(llama, config, config.model)
  assert pages == 4 * 2**30 // page and reason.endswith(f"holds {pages:,}")
  config.cache.fit_pool = True
  pages, reason, _ = sizing.real_pool_pages(llama, config, config.model, pages_needed=99)
  assert pages == 99 and "needs at most 99" in reason
  config.cache.kv_memory_gib = -1.0
  with pytest.raises(ValueError, match=r"cache\.kv_memory_gib must be a finite number"):
    base.check(config)


def test_the_server_holds_its_serving_line_unless_the_scheduler_holds_one():
  from experiments import cli
  config = tiny.get_config()
  assert config.server.ttft_line_s == 0.05 and config.scheduler.max_forecast_ttft_s == 0
  assert cli.hold_serving_line(config) == ("KV watermark 0.4 (server.watermark); forecast "
                                           "TTFT line 0.05 s (server.ttft_line_s)")
  assert config.scheduler.max_forecast_ttft_s == 0.05 and config.scheduler.watermark == 0.4
  config = tiny.get_config()  # a watermark the command line set holds instead
  config.scheduler.watermark = 0.2
  assert cli.hold_serving_line(config, watermark_given=True).startswith(
      "KV watermark 0.2 (scheduler.watermark);")
  assert config.scheduler.watermark == 0.2
  config = tiny.get_config()
  config.scheduler.max_ttft_slowdown = 4.0  # a line of the scheduler's own takes its place
  assert "max_ttft_slowdown 4" in cli.hold_serving_line(config)
  assert config.scheduler.max_forecast_ttft_s == 0
  config = tiny.get_config()
  config.server.ttft_line_s = 0.0  # off
  assert cli.hold_serving_line(config).endswith("; no forecast TTFT line (server.ttft_line_s "
                                                "unset)")
  assert config.scheduler.max_forecast_ttft_s == 0
  assert llama_13b.get_config().server.ttft_line_s == 0.357  # 0.25x the line study's SLO


@pytest.mark.parametrize("value", [-0.1, float("inf"), "0.1", True])
def test_a_serving_line_that_is_not_seconds_is_refused(value):
  server = {**tiny.get_config().server.to_dict(), "ttft_line_s": value}  # as a file may
  with pytest.raises(ValueError,
                     match=r"server\.ttft_line_s must be a finite number >= 0 \(0: off\)"):
    base.check_server(ml_collections.ConfigDict(server))


def test_a_byte_budget_pool_takes_at_most_half_the_hosts_available_memory(monkeypatch):
  from kvpage import premises

  config = tiny.get_config()
  config.cache.num_pages = 0
  page = 2 * 4 * 4 * 2 * 64 * 16
  monkeypatch.setattr(premises, "available_memory_bytes", lambda: 1000 * page)
  pages, reason, _ = sizing.real_pool_pages(llama, config, config.model)
  assert pages == 500 and "capped at 50% of the host memory available: 500" in reason
