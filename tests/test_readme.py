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
  # The linter, then the type checker, then the tests: each gate stops the next.
  assert test_command.endswith(" && ruff check . && mypy && python -m pytest -n 2")


def test_the_type_checker_covers_the_host_world_and_the_contract():
  """A bare `mypy` (the CI command) checks what `[tool.mypy] files` names."""
  pyproject = (ROOT / "pyproject.toml").read_text()
  section = re.search(r"^\[tool\.mypy\]\n(.*?)(?=^\[|\Z)", pyproject, re.S | re.M)
  assert section, "pyproject.toml has no [tool.mypy] section"
  files = re.search(r"^files = \[(.*?)\]", section.group(1), re.M)
  assert files and {"kvpage/host", "kvpage/interface.py"} <= set(
      re.findall(r'"([^"]+)"', files.group(1)))


def test_readme_main_command_runs_an_experiment_with_a_config():
  blocks = _bash_blocks((ROOT / "README.md").read_text())
  main_command = blocks[0]
  assert "pip install -e ." in main_command and "python -m experiments." in main_command
  config = re.search(r"--config=(\S+)", main_command).group(1)
  assert (ROOT / config.split(":")[0]).is_file()
