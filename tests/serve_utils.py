"""A tiny served checkpoint: random Llama weights plus a real, locally trained tokenizer.

The gateway tests need text in and text out, so a real fast tokenizer (chat template,
special tokens, multi-byte text), and a checkpoint `models.hf.load` reads. `hf_utils`
makes its checkpoints with torch, which has no wheel on Python 3.12 in CI; this module
writes the safetensors with numpy and trains a byte-level BPE tokenizer at call time, so
it needs neither torch nor the network.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import tokenizers

from models import text_checkpoint

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
MODEL_MAX_LENGTH = 512
# Jinja; `bos_token` is passed by transformers' apply_chat_template.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
                 "{{ message['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

_HIDDEN, _HEADS, _KV_HEADS, _HEAD_DIM, _LAYERS, _FFN = 64, 4, 2, 16, 2, 96

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A server answers requests as they arrive,
and each request carries a prompt and asks for a number of new tokens. The scheduler
decides which requests run in the next step, and the cache keeps the keys and values of
every token that has been seen. When memory runs short, the scheduler may pause a request
and start it again later, so that the other requests can finish first.
Hello, how are you today? I am fine, thank you. What would you like to talk about?
Tell me a short story about a cat who lived in a library and read books at night.
Once upon a time there was a small cat. She lived in an old library by the river, and
every night, when the people had gone home, she walked between the shelves and read the
titles of the books. Her favourite book was about the sea, because she had never seen it.
One morning the librarian found her asleep on the open pages, and from that day on the
cat had a chair of her own by the window, where the light was warm in the afternoon.
Numbers and dates appear in text too: 1, 2, 3, 10, 42, 100, 2024, 3.14, and 99%.
Questions end with a question mark; lists use commas, colons and semicolons. Some words
are written in capitals, like HTTP, JSON, GPU and API, and some use hyphens: well-known,
long-running, first-come, first-served. Code looks different: def main(): return 0, and
x = [1, 2, 3] or {"key": "value"} or a + b * c.
The weather was cold and clear. We walked to the station, bought two tickets and waited
for the train. It came at ten past nine, five minutes late, and we found seats near the
door. Outside the window the fields were white with frost, and the sun rose slowly over
the hills. By noon we had reached the city, where the streets were full of people.
A good answer is short, true and kind. A model writes one token at a time, and each new
token depends on all the tokens before it. Streaming sends the text to the client as it
is written, so the reader sees the first words before the last ones are ready.
Some words come from other languages: café, naïve, façade, résumé, jalapeño, Zürich,
smörgåsbord, and 日本語 (Japanese), 中文 (Chinese), Ελληνικά (Greek), русский (Russian).
People also write emoji 🙂 😀 👍 🎉 and symbols such as €, £, ©, → and ✓.
"""


def _tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
  """A byte-level BPE tokenizer trained on `_CORPUS`; specials take ids 0, 1, 2."""
  tokenizer = text_checkpoint.train_tokenizer(_CORPUS.splitlines(keepends=True), vocab_size,
                                              (BOS, EOS, PAD))
  if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
    raise ValueError(f"the built-in corpus trains only "
                     f"{tokenizer.get_vocab_size(with_added_tokens=True)} tokens, not "
                     f"vocab_size={vocab_size}; ask for fewer")
  return tokenizer


def make_served_checkpoint(directory: pathlib.Path, *, vocab_size: int = 384,
                           seed: int = 0) -> pathlib.Path:
  """Writes a tiny Llama checkpoint and its tokenizer to `directory`; returns `directory`.

  `models.hf.load` and `transformers.AutoTokenizer.from_pretrained` both read it. The
  tokenizer's vocabulary (specials included) is exactly `vocab_size`, the model's. Encoding
  adds no special tokens; the chat template starts with `<s>` and ends each turn with
  `</s>`, the eos. The same `seed` writes the same bytes.
  """
  tokenizer = _tokenizer(vocab_size)
  ids = {token: tokenizer.token_to_id(token) for token in (BOS, EOS, PAD)}
  assert all(i is not None and i < vocab_size for i in ids.values()), ids
  config = text_checkpoint.llama_config(
      vocab_size=vocab_size, hidden_size=_HIDDEN, intermediate_size=_FFN, num_layers=_LAYERS,
      num_heads=_HEADS, num_kv_heads=_KV_HEADS, head_dim=_HEAD_DIM, max_len=MODEL_MAX_LENGTH,
      special=dict(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD]))
  return text_checkpoint.write(
      directory, config=config, tokenizer=tokenizer,
      tensors=text_checkpoint.random_weights(config, seed, std=0.08),
      tokenizer_config={
          "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
          "pad_token": PAD, "model_max_length": MODEL_MAX_LENGTH,
          "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE},
      generation_config={"bos_token_id": ids[BOS], "eos_token_id": ids[EOS],
                         "pad_token_id": ids[PAD]},
      special_tokens_map={"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})


class ServerProcess:
  """`python -m experiments.serve ...` on 127.0.0.1 with an ephemeral port.

  Starts the process and waits for the line that names its address (warm-up compiles
  first; a shared `--compilation_cache` makes later starts fast). `stop()` sends
  SIGTERM (a drain) and returns the exit status. The server's forecast-TTFT line is off
  unless the flags name it: a test of anything else expects its requests served, and on
  a loaded test machine a line of tens of milliseconds refuses some.
  """

  STARTUP_TIMEOUT_S = 600

  def __init__(self, *flags: str, cache_dir: pathlib.Path, env: dict[str, str] | None = None):
    root = pathlib.Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "experiments.serve", "--host=127.0.0.1", "--port=0",
               f"--compilation_cache={cache_dir}",
               *([] if any("ttft_line_s" in flag for flag in flags) else ["--ttft_line_s=0"]),
               *flags]
    self.process = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True,
                                    env=None if env is None else {**os.environ, **env})
    self.lines: list[str] = []
    deadline = time.monotonic() + self.STARTUP_TIMEOUT_S
    self.url = ""
    while not self.url:
      line = self.process.stdout.readline()
      if not line:
        raise RuntimeError(f"the server exited ({self.process.wait()}) before listening:\n"
                           f"{self.process.stderr.read()}")
      self.lines.append(line)
      found = re.search(r" on (http://127\.0\.0\.1:\d+) ", line)
      if found:
        self.url = found.group(1)
      if time.monotonic() > deadline:
        self.process.kill()
        raise RuntimeError(f"the server did not listen within {self.STARTUP_TIMEOUT_S} s")
    # Keep reading its output, so a chatty server never blocks on a full pipe.
    self.stderr: list[str] = []
    for stream, sink in ((self.process.stdout, self.lines), (self.process.stderr, self.stderr)):
      threading.Thread(target=lambda s=stream, k=sink: k.extend(s), daemon=True).start()

  def stop(self, timeout_s: float = 60) -> int:
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
    try:
      return self.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
      self.process.kill()
      raise


def metric(text: str, name: str, **labels: str) -> float:
  """One sample of Prometheus text (0 if absent): `name{labels...}`, labels in any order."""
  total = 0.0
  for line in text.splitlines():
    if line.startswith("#") or not line.startswith(name):
      continue
    head, value = line.rsplit(" ", 1)
    series, _, label_text = head.partition("{")
    if series != name:
      continue
    found = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
    if all(found.get(key) == want for key, want in labels.items()):
      total += float(value)
  return total
