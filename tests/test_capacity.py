"""The capacity model reproduces the mission's arithmetic and rejects bad premises."""

import pytest

from configs import hardware as hardware_lib
from configs import llama3_8b, llama_13b, tiny
from kvpage import model_shape
from kvpage.sim import capacity

LLAMA_13B = model_shape.ModelShape.from_config(llama_13b.get_config().model)
LLAMA3_8B = model_shape.ModelShape.from_config(llama3_8b.get_config().model)


def test_mission_kv_bytes_for_13b_fp16():
  assert model_shape.kv_bytes_per_token(LLAMA_13B, "fp16") == 819_200
  assert capacity.kv_bytes_per_request(LLAMA_13B, "fp16", 4096) == 3_355_443_200


def test_seed_premises_fit_16_requests():
  # 80 GB and 26 GB of weights, decimal units, no reserve: the mission's figure.
  plan = capacity.plan(LLAMA_13B, seq_len=4096, memory_bytes=80 * 10**9,
                       weight_dtype="fp16", weight_bytes_override=26 * 10**9)
  assert plan.max_concurrent_requests == 16


def test_exact_premises_fit_17_requests():
  assert model_shape.num_parameters(LLAMA_13B) == 13_015_864_320
  assert model_shape.weight_bytes(LLAMA_13B, "fp16") == 26_031_728_640
  plan = capacity.plan(LLAMA_13B, seq_len=4096, weight_dtype="fp16",
                       memory_bytes=hardware_lib.get_hardware("a100_80gb").memory_bytes)
  assert plan.memory_bytes == 80 * 2**30
  assert plan.max_concurrent_requests == 17


def test_reserve_reduces_capacity():
  memory = hardware_lib.get_hardware("a100_80gb").memory_bytes
  plan = capacity.plan(LLAMA_13B, seq_len=4096, weight_dtype="fp16", memory_bytes=memory,
                       reserve_bytes=4 * 10**9)
  # 85.90 - 26.03 - 4 = 55.87 GB of KV pool -> 16 requests of 3.36 GB.
  assert plan.max_concurrent_requests == 16


def test_gqa_divides_kv_bytes_by_group_size():
  assert LLAMA3_8B.group_size == 4
  assert model_shape.kv_bytes_per_token(LLAMA3_8B, "bf16") == 131_072
  mha = model_shape.ModelShape(**{**vars(LLAMA3_8B), "num_kv_heads": 32})
  assert model_shape.kv_bytes_per_token(mha, "bf16") == 4 * 131_072


@pytest.mark.parametrize("dtype,expected", [("fp32", 1_638_400), ("bf16", 819_200),
                                            ("fp16", 819_200), ("fp8", 409_600),
                                            ("int8", 409_600), ("bfloat16", 819_200)])
def test_kv_bytes_per_dtype(dtype, expected):
  assert model_shape.kv_bytes_per_token(LLAMA_13B, dtype) == expected


def test_llama3_8b_parameter_count():
  # Meta's reported count for Llama-3-8B: 8,030,261,248 parameters.
  assert model_shape.num_parameters(LLAMA3_8B) == 8_030_261_248


def test_tied_embeddings_count_once():
  untied = model_shape.ModelShape.from_config(tiny.get_config().model)
  tied = model_shape.ModelShape(**{**vars(untied), "tie_embeddings": True})
  assert model_shape.num_parameters(untied) - model_shape.num_parameters(tied) == 512 * 256


def test_block_rounding_and_pool_tokens():
  assert capacity.pages_for_tokens(17, 16) == 2
  assert capacity.page_waste(17, 16) == (15, 15 / 32)
  assert capacity.page_waste(4096, 16) == (0, 0.0)
  plan = capacity.plan(LLAMA_13B, seq_len=17, weight_dtype="fp16", memory_bytes=80 * 10**9,
                       weight_bytes_override=26 * 10**9)
  assert plan.pages_per_request == 2
  assert plan.pool_pages == 54 * 10**9 // (819_200 * 16)
  assert plan.pool_tokens == plan.pool_pages * 16
  assert plan.max_concurrent_requests == plan.pool_pages // 2
  # Rounded to whole pages on request, exact without.
  assert capacity.kv_bytes_per_request(LLAMA_13B, "fp16", 17, page_size=16) == 32 * 819_200


@pytest.mark.parametrize("call,message", [
    (lambda: capacity.kv_bytes_per_request(LLAMA_13B, "fp16", 0), "seq_len must be a positive"),
    (lambda: capacity.kv_bytes_per_request(LLAMA_13B, "fp16", -5), "seq_len must be a positive"),
    (lambda: model_shape.kv_bytes_per_token(LLAMA_13B, "fp4"), "choose one of: fp32, bf16"),
    (lambda: model_shape.ModelShape(**{**vars(LLAMA_13B), "num_kv_heads": 3}), "must divide"),
    (lambda: model_shape.ModelShape(**{**vars(LLAMA_13B), "num_layers": 0}), "num_layers must be"),
    (lambda: capacity.plan(LLAMA_13B, seq_len=4096, weight_dtype="fp16",
                           memory_bytes=10 * 10**9), "does not fit"),
    (lambda: capacity.plan(LLAMA_13B, seq_len=4096, weight_dtype="fp16", page_size=0,
                           memory_bytes=80 * 10**9), "page_size must be"),
    (lambda: hardware_lib.get_hardware("tpu"), "a100_40gb, a100_80gb, a100_80gb_pcie, cpu"),
])
def test_bad_input_names_the_problem(call, message):
  with pytest.raises(ValueError, match=message):
    call()
