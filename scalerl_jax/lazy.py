"""Lazy package exports (PEP 562), for packages whose public names live in modules that import JAX
(or vLLM) while some process needs the package without it: the buffer imports `rl.npr`, the vLLM
venv imports `generation.vllm.worker`.

  __getattr__, __all__ = lazy.exports(__name__, {"JaxSampler": "sampler", ...})

and lazy third-party modules for costly imports that only some of a process's work needs
(`lazy.module("math_verify")`: SymPy costs ~0.6 CPU-s a process, and most runs never grade math).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
  """(`__getattr__`, `__all__`) for `package`: each public name loads its module on first use."""
  def __getattr__(name):
    if name in names:
      return getattr(importlib.import_module(f"{package}.{names[name]}"), name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
  return __getattr__, sorted(names)


class module:  # noqa: N801  (used like the module it stands for)
  """A stand-in for module `name` that imports it at its first attribute use (thread-safe: the
  import system locks each module while it loads)."""

  def __init__(self, name: str):
    self.__name = name

  def __getattr__(self, attr: str):
    return getattr(importlib.import_module(self.__name), attr)

  def __repr__(self) -> str:
    return f"<lazy module {self.__name!r}>"
