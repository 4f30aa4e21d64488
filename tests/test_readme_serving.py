"""The README's server quick start serves text, and each of its serving examples (curl,
the `openai` client, streaming, chat, metrics) runs as written against it: only the
address changes, to the test server's ephemeral port.

The server is `python -m experiments.serve` with no model flag (the tiny text
checkpoint, made into a temporary cache), its forecast-TTFT line off as in every gateway
test (on a loaded test machine a line of 50 ms refuses some requests).
"""

import pathlib
import re
import subprocess
import sys

import pytest
from serve_utils import ServerProcess

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTION = "## The streaming gateway"
README_URL = "http://127.0.0.1:8000"


def _section() -> str:
  text = (ROOT / "README.md").read_text()
  start = text.index(SECTION)
  end = text.find("\n## ", start + 1)
  return text[start:end if end != -1 else None]


def _blocks(language: str) -> list[str]:
  return re.findall(rf"```{language}\n(.*?)```", _section(), re.S)


def _commands(block: str) -> list[str]:
  """A bash block's commands: continuation lines joined, comments dropped."""
  joined = re.sub(r"\\\n\s*", "", block)
  return [line.split("  #")[0].strip() for line in joined.splitlines()
          if line.strip() and not line.lstrip().startswith("#")]


def test_the_quick_start_is_an_install_and_a_bare_serve():
  quick_start = _commands(_blocks("bash")[0])
  assert quick_start == ['pip install -e ".[serve]"', "python -m experiments.serve"]


@pytest.fixture(scope="module")
def server(cache_dir, tmp_path_factory):
  process = ServerProcess(cache_dir=cache_dir,
                          env={"KVPAGE_CACHE": str(tmp_path_factory.mktemp("kvpage_cache"))})
  yield process
  assert process.stop() == 0


def test_the_bare_server_serves_the_tiny_text_checkpoint(server):
  said = "".join(server.lines)
  assert "serving kvpage's tiny text checkpoint" in said
  assert "model 'kvpage-tiny-text'" in said
  # Compilation says how far it is, in plain lines (not a terminal's progress bar).
  counts = re.findall(r"compiling step programs (\d+)/(\d+)", said)
  assert counts and counts[0][0] == "1" and counts[-1][0] == counts[-1][1]


def test_every_curl_example_runs_as_written(server):
  curls = [command for block in _blocks("bash") for command in _commands(block)
           if command.startswith("curl ")]
  assert len(curls) >= 3, curls
  for command in curls:
    assert README_URL in command, command
    done = subprocess.run(["bash", "-c", command.replace(README_URL, server.url)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (command, done.stderr)
    out = done.stdout
    assert '"error"' not in out, (command, out)
    if "/v1/completions" in command:  # streamed: SSE chunks of text, then [DONE]
      texts = re.findall(r'"text":"((?:[^"\\]|\\.)*)"', out)
      assert "".join(texts).strip() and out.rstrip().endswith("data: [DONE]"), out
    elif "/v1/chat/completions" in command:
      assert re.search(r'"content":"(?:[^"\\]|\\.)+"', out), out
    else:
      assert "kvpage:num_requests_running" in out


def test_the_openai_example_runs_as_written(server):
  (example,) = [block for block in _blocks("python") if "import openai" in block]
  assert README_URL in example
  done = subprocess.run([sys.executable, "-c", example.replace(README_URL, server.url)],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip(), "the streamed chat printed no text"
