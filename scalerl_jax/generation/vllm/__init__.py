"""The vLLM generator backend. `generator.VLLMGenerator` (JAX venv, no vllm/torch import) spawns
`python -m scalerl_jax.generation.vllm.worker` in `.venv-vllm` and talks to it over a Unix socket
(`protocol`); `ext` runs inside vLLM's workers (FP32 head, /dev/shm weight loads); `parity` checks
engine log-probs against ours. Public names load lazily (the vLLM venv has no JAX)."""
from scalerl_jax import lazy

__getattr__, __all__ = lazy.exports(__name__, {
    "VLLMGenerator": "generator", "VLLMWorkerError": "generator", "vllm_python": "generator",
})
