"""Every notebook runs top to bottom on smoke settings, and is committed without outputs.

Each runs in a fresh kernel from this interpreter's environment (nbclient +
ipykernel, in the test extra), with its `parameters` cell followed by the smoke
settings; a cell that raises fails the test with the cell's error.

Outputs are never committed (a stored output goes stale the moment the code changes,
and nothing could tell): the notebooks are stored clean, and with
`KVPAGE_NOTEBOOK_HTML=DIR` set (CI sets it) each executed notebook is rendered to
`DIR/<name>.html`, the outputs of the commit under test.
"""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SMOKE = {"chunked_prefill": 'SCALE = "smoke"', "admission": 'SCALE = "smoke"',
         "capacity": "WASTE_REQUESTS = 12", "which_line": 'SCALE = "smoke"\nREQUESTS = 60',
         "fleet": 'SCALE = "smoke"'}


def test_every_notebook_is_tested():
  assert {path.stem for path in NOTEBOOKS} == set(SMOKE)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_the_notebook_is_committed_without_outputs(path):
  notebook = nbformat.read(path, as_version=4)
  stale = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
           and (cell.get("outputs") or cell.get("execution_count") is not None)]
  assert not stale, (f"{path.name}: cells {stale} hold outputs; clear them (outputs are "
                     "rendered by CI, see this module's docstring)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_the_notebook_runs_on_smoke_settings(path, tmp_path):
  notebook = nbformat.read(path, as_version=4)
  (index,) = [i for i, cell in enumerate(notebook.cells)
              if "parameters" in cell.metadata.get("tags", [])]
  smoke = SMOKE[path.stem] + (f"\nWORKDIR = {str(tmp_path)!r}"
                              if "WORKDIR" in notebook.cells[index].source else "")
  notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(smoke))
  client = nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT / "notebooks")}})
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as error:
    pytest.fail(f"{path.name}: {str(error)[-3000:]}")
  # Every code cell ran (none skipped), and the figures were drawn.
  code = [cell for cell in notebook.cells if cell.cell_type == "code"]
  assert all(cell.get("execution_count") for cell in code)
  images = [output for cell in code for output in cell.get("outputs", [])
            if "image/png" in output.get("data", {})]
  assert images, f"{path.name} drew no figure"
  html = os.environ.get("KVPAGE_NOTEBOOK_HTML")
  if html:
    from nbconvert import HTMLExporter
    body, _ = HTMLExporter().from_notebook_node(notebook)
    pathlib.Path(html).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(html) / f"{path.stem}.html").write_text(body)
