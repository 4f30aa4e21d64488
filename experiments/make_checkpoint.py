r"""Make a tiny Llama checkpoint that serves text, offline (no torch, no model hub).

  python -m experiments.make_checkpoint --out=/tmp/tiny-text
  python -m experiments.serve --checkpoint=/tmp/tiny-text

Random weights of kvpage's `tiny` model and a byte-level BPE tokenizer trained on
kvpage's own docstrings, with a ChatML chat template (`models.text_checkpoint` says what
it writes). `python -m experiments.serve` with no model flag serves the same checkpoint,
made once into a cache directory. Needs the `serve` extra (`tokenizers`, `safetensors`).
"""

import pathlib

from absl import flags

from experiments import cli

_OUT = flags.DEFINE_string("out", None, "Directory to write the checkpoint into (created; "
                           "must be empty if it exists).", required=True)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights.")


def main(argv: list[str]) -> None:
  del argv  # Unused.
  from models import text_checkpoint

  out = pathlib.Path(_OUT.value)
  if not _OUT.value.strip():
    raise ValueError("--out must name a directory")
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ValueError(f"--out={out} exists and is not an empty directory")
  try:
    import tokenizers  # noqa: F401
  except ImportError:
    raise ValueError("making a tokenizer needs the serve extra: pip install -e '.[serve]'"
                     ) from None
  text_checkpoint.make(out, seed=_SEED.value)
  print(f"wrote a tiny text checkpoint (random weights, a {text_checkpoint.VOCAB_SIZE}-token "
        f"BPE) to {out}\nserve it: python -m experiments.serve --checkpoint={out}")


if __name__ == "__main__":
  cli.run(main)
