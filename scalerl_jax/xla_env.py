"""XLA_FLAGS editing for processes that simulate N CPU devices (no JAX import).

One place for the device-count flag: the plan tool's re-exec, the generator's `jax_devices`, the
rehearsal's real-shape learner pods and the tests that start N-device processes all keep the
flags they inherited (e.g. `--xla_cpu_max_isa=AVX2`, or the suite's
`--xla_backend_optimization_level=0`) and replace only the device count.
"""
from __future__ import annotations

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_device_count(flags: str | None, n: int | None) -> str:
  """`flags` (an XLA_FLAGS value) without any device-count flag, plus `DEVICE_COUNT_FLAG=n` when
  `n` is given (None or 0: only removes it)."""
  kept = [f for f in (flags or "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
  return " ".join(kept + ([f"{DEVICE_COUNT_FLAG}={int(n)}"] if n else []))


def device_count(flags: str | None) -> int | None:
  """The device count an XLA_FLAGS value asks for (the last such flag), or None."""
  n = None
  for f in (flags or "").split():
    if f.startswith(DEVICE_COUNT_FLAG + "="):
      n = int(f.split("=", 1)[1])
  return n
