"""The rollout buffer process (no JAX): the gRPC server, its state machine (PipelineRL-k admission,
leases, complete-group batches), the write-ahead log and its replay, and the weight store.

  python -m scalerl_jax.buffer.server --run-config WORKDIR/config.json --port 0 --prompts P.jsonl ...
"""
from scalerl_jax.buffer.replay import read_learner_state, write_learner_state
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.buffer.state import MODES, BufferState

__all__ = ["BufferServer", "BufferState", "MODES", "read_learner_state", "write_learner_state"]
