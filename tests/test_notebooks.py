"""Every notebook runs top to bottom on smoke settings, its claims' assertions included.

Each runs in a fresh kernel from this interpreter's environment (nbclient +
ipykernel, in the test extra), with its `parameters` cell followed by the smoke
settings; a cell that raises fails the test with the cell's error.
"""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SMOKE = {"chunked_prefill": 'SCALE = "smoke"', "admission": 'SCALE = "smoke"',
         "capacity": "WASTE_REQUESTS = 12"}


def test_every_notebook_is_tested():
  assert {path.stem for path in NOTEBOOKS} == set(SMOKE)


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
