"""The package structure's rules, checked from the source: no import cycle among the project's
modules, no import of another module's private (`_x`) name, no module of the package over
MAX_MODULE_LINES lines or function over MAX_FUNCTION_LINES (outside the listed exceptions), no
upward import between the layers docs/ARCHITECTURE.md draws, and the buffer and protocol
packages (and the vLLM worker's modules) importable with JAX blocked."""
from __future__ import annotations

import ast
import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("scalerl_jax", "analysis", "launch", "bench", "configs", "harness")


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for pkg in PACKAGES:
    for path in (ROOT / pkg).rglob("*.py"):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      mods[".".join(parts)] = path
  return mods


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
  if not node.level:
    return node.module or ""
  base = module.split(".") if is_pkg else module.split(".")[:-1]
  base = base[:len(base) - (node.level - 1)]
  return ".".join(base + ([node.module] if node.module else []))


def module_imports(name: str, tree: ast.AST, is_pkg: bool, mods) -> tuple[set[str], list[str]]:
  """(project modules `name`'s source imports, its imports of another module's private names)."""
  out, aliases, private = set(), {}, []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name in mods:
          out.add(a.name)
          aliases[a.asname or a.name] = a.name
    elif isinstance(node, ast.ImportFrom):
      src = _resolve(name, is_pkg, node)
      for a in node.names:
        full = f"{src}.{a.name}"
        if full in mods:                       # a submodule
          out.add(full)
          aliases[a.asname or a.name] = full
        elif src in mods:                      # an attribute of a project module
          out.add(src)
          if a.name.startswith("_") and not a.name.startswith("__"):
            private.append(f"{name}: from {src} import {a.name}")
  for node in ast.walk(tree):                  # mod._private through an imported module
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      private.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
  out.discard(name)
  return out, private


def import_graph():
  """(edges: module -> set of project modules it imports, private: list of offending imports);
  read once per test process, a fresh copy each call (a test may plant edges in it)."""
  edges, private = _import_graph()
  return {k: set(v) for k, v in edges.items()}, list(private)


@functools.lru_cache(maxsize=1)
def _import_graph():
  mods = _modules()
  edges, private = {}, []
  for name, path in mods.items():
    tree = ast.parse(path.read_text(), str(path))
    edges[name], bad = module_imports(name, tree, path.name == "__init__.py", mods)
    private += bad
  return edges, private


def cycles(edges) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        comps.append(sorted(comp))

  sys.setrecursionlimit(10000)
  for v in sorted(edges):
    if v not in index:
      visit(v)
  return comps


def test_cycle_finder_finds_a_planted_cycle():
  edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert cycles(edges) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
  edges, _ = import_graph()
  assert len(edges) > 100          # the whole project was read
  assert cycles(edges) == []


# --- Layers (docs/ARCHITECTURE.md "Layers: the import drawing"): read from the doc itself, so the
# drawing and the check cannot disagree.
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
# Room rules from the process map: (importer prefix, imported prefix, the only targets allowed).
ROOM_RULES = (("scalerl_jax.training", "scalerl_jax.generation",
               ("scalerl_jax.generation.sampler", "scalerl_jax.generation.backends",
                "scalerl_jax.generation.interruption")),)
ENTRY_MODULES = ("scalerl_jax.main", "scalerl_jax.generation.worker",
                 "scalerl_jax.generation.vllm.worker", "scalerl_jax.buffer.server")
ENTRY_IMPORTERS = ("bench", "harness")      # (and the entry module's own package __init__)


def layers_from_doc(text: str) -> dict[str, int]:
  """{module prefix: layer number} from the ```layers block of `text` (`N name : prefix ...`)."""
  block = re.search(r"```layers\n(.*?)```", text, re.S)
  assert block, "docs/ARCHITECTURE.md has no ```layers block"
  out = {}
  for line in block.group(1).splitlines():
    num, _, rest = line.partition(" ")
    for prefix in rest.partition(":")[2].split():
      assert prefix not in out, f"{prefix} is in two layers"
      out[prefix] = int(num)
  return out


def layer_of(module: str, layers: dict[str, int]) -> int | None:
  """The layer of the longest prefix of `module` (whole dotted parts) in `layers`; None if none."""
  parts = module.split(".")
  for n in range(len(parts), 0, -1):
    if ".".join(parts[:n]) in layers:
      return layers[".".join(parts[:n])]
  return None


def upward_imports(edges, layers) -> list[str]:
  """Every import from a lower layer into a higher one, as "a (L) -> b (L)"."""
  bad = []
  for m, deps in sorted(edges.items()):
    lm = layer_of(m, layers)
    for d in sorted(deps):
      ld = layer_of(d, layers)
      if lm is not None and ld is not None and ld > lm:
        bad.append(f"{m} ({lm}) -> {d} ({ld})")
  return bad


def room_violations(edges) -> list[str]:
  """Imports that break ROOM_RULES or reach a process's entry module (ENTRY_MODULES)."""
  bad = []
  for m, deps in sorted(edges.items()):
    for d in sorted(deps):
      for src, dst, allowed in ROOM_RULES:
        if (m + ".").startswith(src + ".") and (d + ".").startswith(dst + ".") and d not in allowed:
          bad.append(f"{m} -> {d} (room rule: {src} reaches {dst} only for {allowed})")
      if (d in ENTRY_MODULES and m.split(".")[0] not in ENTRY_IMPORTERS
          and not d.startswith(m + ".")):
        bad.append(f"{m} -> {d} (an entry module)")
  return bad


def test_every_module_has_a_layer():
  edges, _ = import_graph()
  layers = layers_from_doc(ARCHITECTURE.read_text())
  assert len(set(layers.values())) >= 6
  assert [m for m in sorted(edges) if layer_of(m, layers) is None] == []


def test_no_import_runs_back_up_the_layers():
  edges, _ = import_graph()
  layers = layers_from_doc(ARCHITECTURE.read_text())
  assert upward_imports(edges, layers) == []
  assert room_violations(edges) == []


def test_the_layer_check_fails_on_planted_upward_imports():
  """A planted source in the RL library importing the trainer, one in the config layer importing
  the data library, one in the learner importing the vLLM parity module and one in launch/
  importing the worker: each is named."""
  edges, _ = import_graph()
  mods = _modules()
  layers = layers_from_doc(ARCHITECTURE.read_text())
  planted = {"scalerl_jax.rl.planted": "from scalerl_jax.training import trainer\n",
             "scalerl_jax.config.planted": "from scalerl_jax.data import mixture\n",
             "scalerl_jax.training.planted": "from scalerl_jax.generation.vllm import parity\n",
             "launch.planted": "from scalerl_jax.generation.worker import build_parser\n"}
  for name, src in planted.items():
    edges[name], _ = module_imports(name, ast.parse(src), False, mods)
  assert upward_imports(edges, layers) == [
      "scalerl_jax.config.planted (1) -> scalerl_jax.data.mixture (2)",
      "scalerl_jax.rl.planted (2) -> scalerl_jax.training.trainer (5)"]
  assert room_violations(edges) == [
      "launch.planted -> scalerl_jax.generation.worker (an entry module)",
      "scalerl_jax.training.planted -> scalerl_jax.generation.vllm.parity (room rule: "
      f"scalerl_jax.training reaches scalerl_jax.generation only for {ROOM_RULES[0][2]})"]
  assert layer_of("scalerl_jax.generation.backends", layers) == 2        # longest prefix wins
  assert layer_of("scalerl_jax.config._resolve", layers) == 1
  assert layer_of("scalerl_jax.generation.worker", layers) == 4


def test_the_runtime_package_never_imports_the_harness_or_the_benches():
  """`harness/` (test and fault-injection helpers, the chaos command) and `bench/` are not part
  of any process of a run: nothing under scalerl_jax/ imports them."""
  edges, _ = import_graph()
  bad = sorted((m, d) for m, deps in edges.items() if m.split(".")[0] == "scalerl_jax"
               for d in deps if d.split(".")[0] in ("harness", "bench"))
  assert bad == []
  assert ("harness.chaos", "harness.procs") in {(m, d) for m, deps in edges.items() for d in deps}


def test_the_buffer_state_machine_names_no_grpc_type():
  """buffer/state.py is the admission state machine: its refusals are kinds
  (protocol.validation.precondition, exhausted, ...), the status code is the protocol's choice."""
  def imported(name):
    tree = ast.parse((ROOT / "scalerl_jax" / "buffer" / name).read_text())
    return {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
            for a in n.names} | {n.module.split(".")[0] for n in ast.walk(tree)
                                 if isinstance(n, ast.ImportFrom) and n.module}
  assert "grpc" in imported("server.py")            # the check sees a gRPC import where one is
  assert "grpc" not in imported("state.py")
  assert "grpc" not in (ROOT / "scalerl_jax" / "buffer" / "state.py").read_text()


def test_no_private_name_imported_from_another_module():
  _, private = import_graph()
  assert private == []


MAX_MODULE_LINES = 600     # issue #27: a module longer than this is split along a seam
MAX_FUNCTION_LINES = 80    # issue #47: a function longer than this is split into named steps
SIZE_PACKAGES = ("scalerl_jax", "analysis", "launch", "harness")
# The documented exceptions, each with why (docs/ARCHITECTURE.md "Size"): the test fails on any
# other long unit and on an exception that is no longer long (remove it here).
MODULE_EXCEPTIONS = {
    "harness/chaos.py": "the fault-injection harness (666 lines); edited concurrently on 2026-12-07, "
                        "split after that merge",
}
FUNCTION_EXCEPTIONS = {
    "scalerl_jax/generation/vllm/generator.py::VLLMGenerator.__init__":
        "the vLLM engine's start-up (88 lines); generation/vllm/ is edited concurrently on "
        "2026-12-07, split after that merge",
}


def long_units(rel: str, source: str, max_module: int = MAX_MODULE_LINES,
               max_function: int = MAX_FUNCTION_LINES) -> dict[str, int]:
  """{`rel` or `rel::Class.function`: lines} of a module over `max_module` lines and of each
  function (methods and nested functions included, decorators excluded) over `max_function`."""
  out = {}
  if (n := len(source.splitlines())) > max_module:
    out[rel] = n

  def visit(node, prefix):
    for ch in ast.iter_child_nodes(node):
      if isinstance(ch, ast.ClassDef):
        visit(ch, prefix + ch.name + ".")
      elif isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if (n := (ch.end_lineno or ch.lineno) - ch.lineno + 1) > max_function:
          out[f"{rel}::{prefix}{ch.name}"] = n
        visit(ch, prefix + ch.name + ".")
      else:
        visit(ch, prefix)
  visit(ast.parse(source), "")
  return out


def test_size_finder_finds_planted_long_units():
  body = "".join(f"    x{i} = {i}\n" for i in range(79))
  src = ("class K:\n  def long(self):\n" + body + "    return 1\n"     # 81 lines: too long
         "def ok():\n" + body[:-len("    x78 = 78\n")] + "    return 0\n")   # 80 lines: fine
  assert long_units("m.py", src) == {"m.py::K.long": 81}
  assert long_units("m.py", src, max_module=100) == {"m.py": 162, "m.py::K.long": 81}


def test_no_long_module_or_function_outside_the_documented_exceptions():
  """Modules of scalerl_jax/, analysis/, launch/ and harness/ have at most MAX_MODULE_LINES lines
  and their functions at most MAX_FUNCTION_LINES (the generated protobuf stubs, *_pb2*.py,
  excepted), but for MODULE_EXCEPTIONS / FUNCTION_EXCEPTIONS, each with its reason."""
  found = {}
  for pkg in SIZE_PACKAGES:
    paths = sorted((ROOT / pkg).rglob("*.py"))
    assert len(paths) > 2                        # the package was read
    for p in paths:
      if "_pb2" not in p.name:
        found.update(long_units(p.relative_to(ROOT).as_posix(), p.read_text()))
  allowed = {**MODULE_EXCEPTIONS, **FUNCTION_EXCEPTIONS}
  assert sorted(set(found) - set(allowed)) == [], {k: found[k] for k in found if k not in allowed}
  assert sorted(set(allowed) - set(found)) == [], "no longer long: remove from the exceptions"
  assert all(len(why) > 20 for why in allowed.values())


# Function-local imports (issue #27): at most MAX_LOCAL_IMPORTS over these packages, each with a
# one-line reason on its line (`# local: <reason>`): a JAX-free / vLLM-venv module, an optional or
# torch-pulling dependency, a TPU-only module. Everything else imports at the module's top (a
# deferral several functions share: one `lazy.module(...)` at the top, scalerl_jax/lazy.py).
LOCAL_IMPORT_PACKAGES = ("scalerl_jax", "analysis", "launch")
MAX_LOCAL_IMPORTS = 30
LOCAL_REASON = "# local:"


def local_imports(source: str) -> list[tuple[int, bool]]:
  """(line, has a `# local:` reason) of each import statement inside a function body of `source`
  (nested functions included, each statement once; a reason on any line of the statement)."""
  lines = source.splitlines()
  found = {}
  for fn in ast.walk(ast.parse(source)):
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for n in ast.walk(fn):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
          found[n.lineno] = any(LOCAL_REASON in lines[i - 1]
                                for i in range(n.lineno, n.end_lineno + 1))
  return sorted(found.items())


def test_local_import_finder_finds_planted_ones():
  src = ("import os\n"
         "from typing import Any\n"
         "class C:\n"
         "  import json\n"                       # class body: not in a function
         "  def m(self):\n"
         "    import re\n"
         "def f():\n"
         "  import glob  # local: a reason\n"
         "  from x import (a,\n"
         "                 b)  # local: on its last line\n"
         "  def g():\n"
         "    from y import z\n"
         "async def h():\n"
         "  import zlib\n")
  assert local_imports(src) == [(6, False), (8, True), (9, True), (12, False), (14, False)]
  assert local_imports("import os\nx = 1\n") == []


def test_function_local_imports_are_few_and_explained():
  found = {}
  for pkg in LOCAL_IMPORT_PACKAGES:
    for path in sorted((ROOT / pkg).rglob("*.py")):
      if "_pb2" not in path.name:
        found[path.relative_to(ROOT).as_posix()] = local_imports(path.read_text())
  total = sum(len(v) for v in found.values())
  assert total > 0                                     # the walk saw the deliberate ones
  assert total <= MAX_LOCAL_IMPORTS, {k: [i for i, _ in v] for k, v in found.items() if v}
  unexplained = [f"{k}:{i}" for k, v in found.items() for i, ok in v if not ok]
  assert unexplained == [], f"function-local imports without a '{LOCAL_REASON} <reason>' comment"


_BLOCK_JAX = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax"):
      raise ImportError(f"{name} is blocked: this process must not import JAX")
sys.meta_path.insert(0, Block())
import importlib
for m in sys.argv[1:]:
  importlib.import_module(m)
assert not any(k.split(".")[0] in ("jax", "flax") for k in sys.modules)
print("ok")
"""


@pytest.mark.parametrize("modules", [
    ["scalerl_jax.buffer", "scalerl_jax.buffer.server", "scalerl_jax.buffer.replay"],
    ["scalerl_jax.protocol", "scalerl_jax.protocol.codec", "scalerl_jax.protocol.weight_chunks"],
    ["scalerl_jax.generation.vllm.worker", "scalerl_jax.generation.vllm.protocol",
     "scalerl_jax.types", "scalerl_jax.rewards"],
])
def test_jax_free_packages_import_with_jax_blocked(modules):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-c", _BLOCK_JAX, *modules], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "ok"


def test_the_blocker_blocks():
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-c", _BLOCK_JAX, "scalerl_jax.generation.sampler"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
  assert out.returncode != 0 and "must not import JAX" in out.stderr


def test_process_entry_points_do_not_import_sympy_or_matplotlib_until_used():
  """`import scalerl_jax.main` / `generation.worker` leave SymPy (math_verify) and matplotlib to
  their first use (lazy.module): 0.6 CPU-s each, paid by every process a run or a test starts.
  The first math grade and the first plot do load them."""
  code = ("import sys, scalerl_jax.main, scalerl_jax.generation.worker\n"
          "heavy = lambda: sorted(m for m in ('sympy', 'matplotlib', 'math_verify') if m in sys.modules)\n"
          "before = heavy()\n"
          "from scalerl_jax.rewards.math import math_reward\n"
          "from scalerl_jax import lazy\n"
          "r = math_reward('</think> 1/2', '0.5')\n"
          "lazy.module('matplotlib.figure').Figure()\n"
          "print(before, heavy(), r)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["[]", "['math_verify',", "'matplotlib',", "'sympy']", "1.0"], out.stdout
