"""Rollout system: protocol, gRPC buffer, generators (JAX sampler, vLLM worker), interruption."""
