"""`benchmarks/decode_floor.py` removes attention from both sides alike
(`benchmarks/identity_attention.py`).

Its verdict (can a faster attention alone reach the target?) compares kvpage and HF
each with attention replaced by the identity; that is fair only if the two identity
models are the same network. On the same checkpoint their logits must agree, and
differ from the real models' (so the identity is really in use), and the swap of
kvpage's attention entry must not outlive its context.
"""

import numpy as np
from hf_utils import hf_logits, make_checkpoint
from test_llama_hf import PROMPTS, prefill_logits

from benchmarks import identity_attention
from kvpage.device import backends
from models import hf


def test_identity_models_agree_across_frameworks(tmp_path):
  real_hf = make_checkpoint(tmp_path)  # skips where torch has no wheel
  import transformers

  identity_hf = transformers.LlamaForCausalLM.from_pretrained(
      tmp_path, attn_implementation=identity_attention.register_hf()).eval()
  config, params = hf.load(tmp_path)
  original = backends.Ops.attention
  prompt = PROMPTS[2]
  with identity_attention.in_kvpage():
    ours = prefill_logits(config, params, prompt)
  assert backends.Ops.attention is original
  theirs = hf_logits(identity_hf, prompt)
  assert np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)) < 1e-4
  real = hf_logits(real_hf, prompt)
  assert np.max(np.abs(real - theirs)) / np.max(np.abs(real)) > 1e-2  # attention mattered
