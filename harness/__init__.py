"""Test and fault-injection harness shared by `tests/`, `bench/` and the chaos command
(`python -m harness.chaos`): process-tree helpers, free ports and polling (`harness.procs`).
Nothing in the runtime package (`scalerl_jax`) imports it."""
