"""The fleet extra is optional: without Ray, kvpage imports and runs, and the fleet
command says in one line how to install it.

Ray's absence is made with a `ray` package on the path that cannot be imported (as an
uninstalled one cannot), so the check holds whether or not the extra is installed here.
"""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _without_ray(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
  fake = tmp_path / "no_ray" / "ray"
  fake.mkdir(parents=True)
  (fake / "__init__.py").write_text(
      'raise ModuleNotFoundError("No module named \'ray\'", name="ray")\n')
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(fake.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)


def test_kvpage_imports_and_routes_without_ray(tmp_path):
  code = """
import importlib
for name in ("kvpage", "kvpage.serve.app", "kvpage.serve.server", "kvpage.host.routing",
             "kvpage.sim.fleet", "kvpage.build", "experiments.serve", "experiments.replica"):
  importlib.import_module(name)
try:
  import kvpage.serve.ray_fleet
except ModuleNotFoundError as error:
  assert error.name == "ray", error
else:
  raise AssertionError("ray imported: the fake did not hide it")
from kvpage.host import routing
router = routing.Router("kv_headroom")
router.update([routing.ReplicaStats("a", headroom_pages=4),
               routing.ReplicaStats("b", headroom_pages=9)])
assert router.rank(routing.RouteRequest(16, 16)) == ["b", "a"]
print("ok")
"""
  done = _without_ray(tmp_path, "-c", code)
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_fleet_command_without_ray_says_how_to_install(tmp_path):
  done = _without_ray(tmp_path, "-m", "experiments.serve", "--executor=sim", "--replicas=2",
                      "--port=0")
  assert done.returncode == 2, done.stderr
  assert done.stderr.strip().splitlines() == [
      "error: --replicas needs the fleet extra (ray is missing): pip install -e '.[fleet]'"]
  assert done.stdout == ""
