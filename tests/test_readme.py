"""The README's two commands are the ones CI and users run."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
  return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_ci_runs_the_readme_test_command():
  blocks = _bash_blocks((ROOT / "README.md").read_text())
  test_command = next(block for block in blocks if "pytest" in block)
  assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_main_command_runs_an_experiment_with_a_config():
  blocks = _bash_blocks((ROOT / "README.md").read_text())
  main_command = blocks[0]
  assert "pip install -e ." in main_command and "python -m experiments." in main_command
  config = re.search(r"--config=(\S+)", main_command).group(1)
  assert (ROOT / config.split(":")[0]).is_file()
