"""The generator process: the `Generator` interface every backend implements, the embedded JAX
sampler, the worker loop (lease -> generate -> reward -> push, weights swapped in flight), the
length-control helpers, and `vllm/` (the vLLM backend, whose engine runs in its own venv).

A new generator backend: its `Engine` subclass (generator.py) in a module of its own, and one
`register(Backend(...))` line in backends.py; the worker never names a backend.
Public names load lazily: the vLLM venv imports `generation.vllm.worker` without JAX.
"""
from scalerl_jax import lazy

__getattr__, __all__ = lazy.exports(__name__, {
    "Generator": "generator", "JaxSampler": "sampler", "Worker": "worker",
    "run_fake_generator": "fake", "ScriptedInstructModel": "fake",
})
