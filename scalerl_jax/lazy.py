"""Lazy package exports (PEP 562), for packages whose public names live in modules that import JAX
(or vLLM) while some process needs the package without it: the buffer imports `rl.npr`, the vLLM
venv imports `generation.vllm.worker`.

  __getattr__, __all__ = lazy.exports(__name__, {"JaxSampler": "sampler", ...})
"""
from __future__ import annotations

import importlib


def exports(package: str, names: dict[str, str]):
  """(`__getattr__`, `__all__`) for `package`: each public name loads its module on first use."""
  def __getattr__(name):
    if name in names:
      return getattr(importlib.import_module(f"{package}.{names[name]}"), name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
  return __getattr__, sorted(names)
