"""The learner process's loop and its companions: `job` (one run: processes, SFT warm start, the
trainer, the end-of-run fit), `trainer` (the step loop, evaluation, publishing, checkpoints),
`checkpoint` (orbax saves and restores), `ledger` (the compute axis), `health` (run health and
the live forecast), `fleet_eval` (evaluation through the generator fleet), `sft` (the warm start),
`tracking` / `wandb_sink` (metrics.jsonl, TensorBoard, W&B). Process-shared modules stay at the
top of `scalerl_jax/`; the jitted step itself is `scalerl_jax.learner`."""
