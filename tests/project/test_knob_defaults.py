"""Every config knob's default is written once, in the config layer's sections
(scalerl_jax/config/_sections.py, _run.py; issue #47): no library
function parameter has a declared knob's name AND the same literal default. A parameter that
needs the knob takes it from its section at the call site, or defaults to the declaration itself
(`n_draws: int = common.Forecast.n_draws`), which is one place, not two. AST only: no imports."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = ("scalerl_jax", "launch", "harness", "analysis")

# Field names that also name a generic quantity, with its own meaning, in many signatures.
GENERIC = {
    "seed": "every random function takes a seed; RunConfig.seed is the run's",
    "port": "every server's port; 0 asks the kernel for a free one",
    "path": "a file path",
    "dtype": "a tensor dtype",
    "temperature": "1.0 is the untempered log-prob (the identity), not the sampling knob",
}

# Restated defaults not removed yet, each with why (none left on 2026-12-07, commit after 2624343).
# The test fails when one is fixed (remove it here) and on any new one.
KNOWN: set[str] = set()


def declared_knobs(source: str) -> dict[str, list[tuple[str, object]]]:
  """{field name: [(section class, literal default), ...]} of the dataclass sections in `source`."""
  out: dict[str, list[tuple[str, object]]] = {}
  for cls in ast.parse(source).body:
    if isinstance(cls, ast.ClassDef):
      for st in cls.body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
          try:
            out.setdefault(st.target.id, []).append((cls.name, ast.literal_eval(st.value)))
          except ValueError:       # a computed default (a factory, a call): nothing to restate
            pass
  return out


def _same(a, b) -> bool:
  return a is not None and isinstance(a, bool) == isinstance(b, bool) and type(a) in (
      bool, int, float, str) and a == b


def restated_defaults(rel: str, source: str, knobs) -> list[str]:
  """`rel::Class.function(param)` for each parameter of `source` named like a knob (GENERIC
  excepted) whose literal default equals that knob's default."""
  out = []

  def visit(node, prefix):
    for ch in ast.iter_child_nodes(node):
      if isinstance(ch, ast.ClassDef):
        visit(ch, prefix + ch.name + ".")
      elif isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = ch.args
        pos = a.posonlyargs + a.args
        pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults)) + [
            (x, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
        for arg, d in pairs:
          if arg.arg in knobs and arg.arg not in GENERIC:
            try:
              v = ast.literal_eval(d)
            except ValueError:
              continue
            if any(_same(v, kv) for _, kv in knobs[arg.arg]):
              out.append(f"{rel}::{prefix}{ch.name}({arg.arg})")
        visit(ch, prefix + ch.name + ".")
      else:
        visit(ch, prefix)
  visit(ast.parse(source), "")
  return out


SECTIONS = ("scalerl_jax/config/_sections.py", "scalerl_jax/config/_run.py")


def schema_knobs() -> dict[str, list[tuple[str, object]]]:
  """declared_knobs of the config layer's section modules, together."""
  return declared_knobs("\n".join((ROOT / p).read_text() for p in SECTIONS))


def all_restated() -> list[str]:
  knobs = schema_knobs()
  found = []
  for pkg in LIBRARY:
    for p in sorted((ROOT / pkg).rglob("*.py")):
      if "_pb2" not in p.name:
        found += restated_defaults(p.relative_to(ROOT).as_posix(), p.read_text(), knobs)
  return found


def test_no_library_signature_restates_a_knob_default():
  knobs = schema_knobs()
  assert len(knobs) > 150 and ("Buffer", 120.0) in knobs["lease_ttl_s"]   # the schema was read
  found = set(all_restated())
  assert sorted(found - KNOWN) == [], "a knob's default restated in a signature: take it from its section"
  assert sorted(KNOWN - found) == [], "fixed: remove these from KNOWN"


def test_the_finder_finds_planted_restatements():
  knobs = declared_knobs("class Buffer:\n  lease_ttl_s: float = 120.0\n  wal_fsync: str = 'batch'\n"
                         "  tasks: tuple = dataclasses.field(default_factory=tuple)\n"
                         "class RL:\n  npr: bool = False\n  seed: int = 0\n")
  src = ("def f(x, lease_ttl_s=120.0, wal_fsync='none', npr=0):\n  pass\n"      # 1 hit: 0 is not False
         "class S:\n  def __init__(self, *, lease_ttl_s: float = 120, seed=0):\n    pass\n"
         "def g(lease_ttl_s=common.Buffer.lease_ttl_s, npr=False):\n  pass\n")
  assert restated_defaults("m.py", src, knobs) == [
      "m.py::f(lease_ttl_s)", "m.py::S.__init__(lease_ttl_s)", "m.py::g(npr)"]
