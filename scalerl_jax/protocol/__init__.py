"""The wire between a run's processes (no JAX): the rollout.proto messages and stubs, tensor codec,
zero-copy request parsing (wire), field validation, weight-chunk framing, the RPC basics shared by
every server (service name, channel options, bearer-token auth, TLS credentials) and the buffer client.

Depends on `scalerl_jax.types` only; the buffer, the generators and the learner depend on it.
"""
from scalerl_jax.protocol.client import Batch, BufferClient, assignment_prompt, batch_to_arrays
from scalerl_jax.protocol.rpc import SERVICE, TLS, AuthInterceptor, channel_options
from scalerl_jax.protocol.validation import Limits, RejectError

__all__ = ["Batch", "BufferClient", "assignment_prompt", "batch_to_arrays", "SERVICE",
           "AuthInterceptor", "TLS", "channel_options", "Limits", "RejectError"]
