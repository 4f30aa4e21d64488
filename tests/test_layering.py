"""The dependency rule, read from the source: which world may import what, and no cycles.

Rules (docs/architecture.md explains why):
  * the host world — every module under `kvpage/host`, `kvpage/sim` and `kvpage/serve`, plus
    `kvpage/interface.py` and `kvpage/batch.py` — never imports jax, jaxlib, flax, optax,
    chex or `kvpage.device`;
  * nothing under `kvpage` imports `configs`, `models`, `experiments`, `benchmarks` or the
    tests;
  * the project's modules (`kvpage`, `models`, `configs`, `experiments`, `benchmarks`)
    import one another without a cycle.

Modules are found by walking folders, never listed by hand, so a new module is checked
the day it lands. Imports are read with `ast` in every form: `import x`, `from x import
y` (where `y` may be a submodule), relative imports, and imports inside functions.

`if TYPE_CHECKING:` imports count for the two import rules but not for cycles. They never
run, so they cannot load jax, but a host module annotated with a device type still
depends on the device world in its meaning, and the type checker would then read device
code on the host's behalf. They are, on the other hand, the usual way to name a type
without executing an import, so they close no cycle at import time. Imports inside
functions likewise count for the rules (they run when called) but not for the
module-level cycle graph.
"""

import ast
import dataclasses
import json
import pathlib
import subprocess
import sys
from collections.abc import Iterable, Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOST_WORLD = ("kvpage/host", "kvpage/sim", "kvpage/serve", "kvpage/interface.py",
              "kvpage/batch.py", "kvpage/clock.py", "kvpage/premises.py", "kvpage/metrics.py",
              "kvpage/memory_plan.py", "kvpage/model_shape.py", "kvpage/units.py",
              "kvpage/request.py")
# The backends seam (kvpage/device/backends): the registry is the package itself; each
# backend is a folder under it. Nothing else names one.
BACKENDS = "kvpage/device/backends"
BACKEND_MODULES = tuple(f"kvpage.device.backends.{path.name}"
                        for path in sorted((ROOT / BACKENDS).iterdir()) if path.is_dir()
                        and path.name != "__pycache__")
RUN_CHOICES = ("attention_impl", "linear_impl", "matmul_precision")
DEVICE_ONLY = ("jax", "jaxlib", "flax", "optax", "chex", "kvpage.device")
PROJECT = ("kvpage", "models", "configs", "experiments", "benchmarks")
# The tests import their helpers as top-level modules (`engine_utils`), so each file's
# stem is a name the library must not import either.
OUTSIDE_LIBRARY = ("configs", "models", "experiments", "benchmarks", "tests",
                   *sorted(path.stem for path in (ROOT / "tests").glob("*.py")))


@dataclasses.dataclass(frozen=True)
class Import:
  """One import statement: `import names` or `from base import names`, `base` absolute.

  `module_level` is False inside functions and `if TYPE_CHECKING:` blocks: code that
  does not run when the module is imported.
  """

  importer: str
  line: int
  module_level: bool
  names: tuple[str, ...]
  base: str | None = None

  @property
  def targets(self) -> list[str]:
    """Every name it may load: `from a import b` may load `a` and, if it is a module, `a.b`."""
    if self.base is None:
      return list(self.names)
    return [self.base, *(f"{self.base}.{name}" for name in self.names if name != "*")]


def walk(root: pathlib.Path, top: str) -> Iterator[tuple[str, pathlib.Path]]:
  """`(dotted module name, path)` for every module under `root/top` (a folder or a file)."""
  start = root / top
  if not start.exists():  # a moved folder must fail the rules, not empty them
    raise FileNotFoundError(f"{start} does not exist: update the layering rules")
  paths = [start] if start.is_file() else sorted(start.rglob("*.py"))
  for path in paths:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if "__pycache__" in parts:
      continue
    if parts[-1] == "__init__":
      parts.pop()
    yield ".".join(parts), path


def _is_type_checking(test: ast.expr) -> bool:
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
      isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
  """The absolute name of `from <level dots><module> import ...` inside `importer`."""
  if level == 0:
    return module or ""
  parts = importer.split(".")
  base = parts if is_package else parts[:-1]
  base = base[:len(base) - (level - 1)]
  return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: pathlib.Path) -> list[Import]:
  """Every import statement of the module, at any depth."""
  is_package = path.name == "__init__.py"
  found: list[Import] = []

  def visit(node: ast.AST, module_level: bool) -> None:
    if isinstance(node, ast.Import):
      names = tuple(alias.name for alias in node.names)
      found.append(Import(name, node.lineno, module_level, names))
    elif isinstance(node, ast.ImportFrom):
      names = tuple(alias.name for alias in node.names)
      base = _resolve(name, is_package, node.level, node.module)
      found.append(Import(name, node.lineno, module_level, names, base))
    if isinstance(node, ast.If) and _is_type_checking(node.test):
      for child in node.body:
        visit(child, False)
      for child in node.orelse:
        visit(child, module_level)
      return
    inner = module_level and not isinstance(
        node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    for child in ast.iter_child_nodes(node):
      visit(child, inner)

  visit(ast.parse(path.read_text(), str(path)), True)
  return found


def _matches(target: str, prefixes: Iterable[str]) -> bool:
  return any(target == prefix or target.startswith(prefix + ".") for prefix in prefixes)


def violations(root: pathlib.Path, tops: Iterable[str], forbidden: Iterable[str]) -> list[str]:
  """`importer:line imports target` for each forbidden import of the modules under `tops`."""
  forbidden = tuple(forbidden)
  found = set()
  for top in tops:
    for name, path in walk(root, top):
      for imp in imports_of(name, path):
        found.update(f"{path.relative_to(root)}:{imp.line} imports {target}"
                     for target in imp.targets if _matches(target, forbidden))
  return sorted(found)


def import_graph(root: pathlib.Path, tops: Iterable[str]) -> dict[str, set[str]]:
  """Module-level imports among the modules under `tops`: importer -> imported modules.

  An import points at the most specific module it names: `from a import b` at `a.b` when
  that is a module, else at `a`; `from a.b import C` at `a.b`. A submodule's import of
  its own package is thus no edge to the package's `__init__`, which is already loading
  whenever a package imports its submodules: that is no cycle at import time.
  """
  modules = {name: path for top in tops for name, path in walk(root, top)}
  graph: dict[str, set[str]] = {name: set() for name in modules}
  for name, path in modules.items():
    for imp in imports_of(name, path):
      if not imp.module_level:
        continue
      named = imp.names if imp.base is None else [
          f"{imp.base}.{alias}" if f"{imp.base}.{alias}" in modules else imp.base
          for alias in imp.names]
      for target in named:
        while target and target not in modules:  # `a.b.C` -> `a.b`
          target = target.rpartition(".")[0]
        if target:
          graph[name].add(target)
  return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle `[a, b, ..., a]` per strongly connected component that has one (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  components: list[set[str]] = []

  def connect(node: str) -> None:
    index[node] = low[node] = len(index)
    stack.append(node)
    for succ in sorted(graph.get(node, ())):
      if succ not in index:
        connect(succ)
        low[node] = min(low[node], low[succ])
      elif succ in stack:
        low[node] = min(low[node], index[succ])
    if low[node] == index[node]:
      component = set()
      while True:
        member = stack.pop()
        component.add(member)
        if member == node:
          break
      if len(component) > 1 or node in graph.get(node, ()):
        components.append(component)

  for node in sorted(graph):
    if node not in index:
      connect(node)
  return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
  """A shortest path from the component's first module back to itself (breadth first)."""
  start = min(component)
  paths = {start: [start]}
  frontier = [start]
  while frontier:
    following = []
    for node in frontier:
      for succ in sorted(graph[node] & component):
        if succ == start:
          return [*paths[node], start]
        if succ not in paths:
          paths[succ] = [*paths[node], succ]
          following.append(succ)
    frontier = following
  raise AssertionError(f"no cycle through {start} in its component")


# The rules, on this repository.
def test_host_world_never_imports_jax_or_the_device_world():
  assert violations(ROOT, HOST_WORLD, DEVICE_ONLY) == []


def test_library_never_imports_configs_models_experiments_benchmarks_or_tests():
  assert violations(ROOT, ["kvpage"], OUTSIDE_LIBRARY) == []


def test_project_modules_import_without_cycles():
  cycles = find_cycles(import_graph(ROOT, PROJECT))
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def _outside_backends() -> list[str]:
  """Every folder and file of the project's code but the backends seam itself."""
  tops = ["models", "configs", "experiments"]
  for path in sorted((ROOT / "kvpage").rglob("*.py")):
    relative = path.relative_to(ROOT).as_posix()
    if "__pycache__" not in relative and not relative.startswith(BACKENDS + "/"):
      tops.append(relative)
  return tops


def test_only_the_registry_and_the_backends_import_a_backend():
  """Models, the library and the experiments reach a backend through the registry
  (`kvpage.device.backends`), never a backend's own modules (the CPU kernels, Pallas)."""
  assert len(BACKEND_MODULES) >= 3, BACKEND_MODULES  # xla, cpu, pallas at least
  assert violations(ROOT, _outside_backends(), BACKEND_MODULES) == []


def test_only_the_registry_dispatches_on_a_run_choice():
  """No comparison involving a run choice (`attention_impl == "mosaic"`) outside the
  backends seam: which code runs is decided in one place."""
  found = []
  for top in _outside_backends():
    for _, path in walk(ROOT, top):
      source = path.read_text()
      for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
          text = ast.get_source_segment(source, node) or ""
          if any(choice in text for choice in RUN_CHOICES):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
  assert found == []


def test_the_contract_imports_nothing_from_the_host():
  """`kvpage/interface.py` is the ground floor: the host world builds on it, not under it."""
  assert violations(ROOT, ["kvpage/interface.py"], ["kvpage.host"]) == []


def test_host_world_runs_without_jax():
  """Importing every host-world module leaves jax and the device world out of sys.modules."""
  names = [name for top in HOST_WORLD for name, _ in walk(ROOT, top)]
  code = ("import importlib, json, sys\n"
          "names, forbidden = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
          "for name in names: importlib.import_module(name)\n"
          "print(json.dumps([importlib.import_module('kvpage').__file__,\n"
          "                  [module for module in forbidden if module in sys.modules]]))\n")
  result = subprocess.run(
      [sys.executable, "-c", code, json.dumps(names), json.dumps(DEVICE_ONLY)], cwd=ROOT,
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  kvpage_file, loaded = json.loads(result.stdout.splitlines()[-1])
  assert pathlib.Path(kvpage_file).is_relative_to(ROOT), kvpage_file  # this tree's kvpage
  assert loaded == [], f"importing the host world loaded {loaded}"


# The helpers, on planted examples: a rule that can see nothing passes silently.
def test_walk_finds_every_world():
  host = dict(walk(ROOT, "kvpage/host")) | dict(walk(ROOT, "kvpage/sim"))
  assert {"kvpage.host", "kvpage.host.scheduler", "kvpage.host.pages",
          "kvpage.sim.executor"} <= set(host)
  assert dict(walk(ROOT, "kvpage/batch.py")) == {"kvpage.batch": ROOT / "kvpage/batch.py"}
  names = [name for top in HOST_WORLD for name, _ in walk(ROOT, top)]
  assert 15 <= len(names) <= 60 and len(set(names)) == len(names)
  assert all(any(walk(ROOT, top)) for top in HOST_WORLD + PROJECT)
  project = {name for top in PROJECT for name, _ in walk(ROOT, top)}
  assert {"kvpage.device.executor", "kvpage.device.backends.pallas.decode", "models.llama",
          "configs.tiny", "experiments.serve_bench", "benchmarks.timing"} <= project


def test_rules_see_the_device_world_and_the_graph_has_edges():
  assert violations(ROOT, ["kvpage/device"], DEVICE_ONLY), "jax imports went unseen"
  graph = import_graph(ROOT, PROJECT)
  assert "kvpage.host.pages" in graph["kvpage.host.scheduler"]
  assert "kvpage.batch" in graph["kvpage.device.executor"]
  assert sum(map(len, graph.values())) > 50


def _plant(root: pathlib.Path, files: dict[str, str]) -> None:
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_every_import_form_is_caught(tmp_path):
  _plant(tmp_path, {
      "kvpage/__init__.py": "",
      "kvpage/device/__init__.py": "",
      "kvpage/device/cache.py": "",
      "kvpage/host/__init__.py": "",
      "kvpage/host/a.py": "from kvpage import device\n",
      "kvpage/host/b.py": "def f():\n  import jax.numpy as jnp\n  return jnp\n",
      "kvpage/host/c.py": "from ..device import cache\n",
      "kvpage/host/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  import flax\n",
      "kvpage/host/e.py": "from . import a\nimport numpy\nfrom kvpage.host import b\n",
      "kvpage/batch.py": "class C:\n  def m(self):\n    from chex import assert_shape\n",
  })
  found = violations(tmp_path, ["kvpage/host", "kvpage/batch.py"], DEVICE_ONLY)
  assert found == ["kvpage/batch.py:3 imports chex",
                   "kvpage/batch.py:3 imports chex.assert_shape",
                   "kvpage/host/a.py:1 imports kvpage.device",
                   "kvpage/host/b.py:2 imports jax.numpy",
                   "kvpage/host/c.py:1 imports kvpage.device",
                   "kvpage/host/c.py:1 imports kvpage.device.cache",
                   "kvpage/host/d.py:3 imports flax"]


def test_a_planted_cycle_is_found_and_printed(tmp_path):
  _plant(tmp_path, {
      "pkg/__init__.py": "",
      "pkg/a.py": "from pkg import b\n",
      "pkg/b.py": "import pkg.c as c\n",
      "pkg/c.py": "from . import a\n",
      "pkg/d.py": "from pkg.a import thing\n",  # into the cycle, not part of it
      "pkg/e.py": "def f():\n  from pkg import d\n",  # deferred: no module-level edge
      "pkg/f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from pkg import e\n",
  })
  graph = import_graph(tmp_path, ["pkg"])
  assert graph["pkg.d"] == {"pkg.a"} and graph["pkg.e"] == set() and graph["pkg.f"] == set()
  assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
  assert find_cycles({"x": {"x"}, "y": set()}) == [["x", "x"]]
  assert find_cycles({"x": {"y"}, "y": set()}) == []


def test_a_missing_folder_fails_loudly(tmp_path):
  with pytest.raises(FileNotFoundError, match="update the layering rules"):
    violations(tmp_path, ["kvpage/host"], DEVICE_ONLY)
