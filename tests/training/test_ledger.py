"""The compute ledger's analytic FLOPs against a hand count (issue #28, docs/COMPUTE.md "What the
FLOPs count"): every real token the learner processes is counted (prompts, injected tokens,
zero-variance-filtered groups), padding is not."""
import numpy as np

from scalerl_jax.training.ledger import ComputeLedger, StepTokens
from scalerl_jax.protocol import client, codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.training.trainer import pad_time
from scalerl_jax.types import Completion

N = 1000.0   # active parameters per token


def _rollout(gid, j, prompt, policy_mask, reward):
  L = len(policy_mask)
  c = Completion(prompt_id=10 + gid, tokens=np.arange(1, L + 1, dtype=np.int32),
                 logprobs=np.where(policy_mask, -0.5, 0.0).astype(np.float32),
                 versions=np.zeros(L, np.int32), policy_mask=np.asarray(policy_mask, bool),
                 finish_reason="stop", reward=reward)
  return codec.completion_to_rollout(c, group_id=gid, sample_index=j,
                                     prompt_tokens=np.asarray(prompt, np.int32), generator_id="g")


def _hand_batch():
  """Group 0: prompt of 3 tokens; rollouts of 4 and 2 sampled tokens, rewards 1 and 0 (kept).
  Group 1: prompt of 2 tokens; an interrupted rollout of 5 tokens (2 sampled, 2 injected, 1
  sampled) and one of 1 sampled token, rewards 1 and 1: zero variance, filtered out of the loss.
  Row lengths 7, 5, 7, 3: T = 7, padded to the trainer's 32-token bucket."""
  g0 = [_rollout(0, 0, [5, 6, 7], [1, 1, 1, 1], 1.0), _rollout(0, 1, [5, 6, 7], [1, 1], 0.0)]
  g1 = [_rollout(1, 0, [8, 9], [1, 1, 0, 0, 1], 1.0), _rollout(1, 1, [8, 9], [1], 1.0)]
  groups = [pb.Group(group_id=0, prompt_id=10, rollouts=g0),
            pb.Group(group_id=1, prompt_id=11, rollouts=g1)]
  return pad_time(client.batch_to_arrays(client.Batch(0, groups, pb.BatchSummary())), 32, 64)


def test_step_tokens_hand_count():
  full = _hand_batch()
  assert full["tokens"].shape == (4, 32)
  assert full["prompt_lengths"].tolist() == [3, 3, 2, 2]
  assert full["completion_lengths"].tolist() == [4, 2, 5, 1]
  # The loss tokens of kept groups, computed as the learner does (weights > 0 & loss_mask).
  from scalerl_jax.learner.batch import RLSpec, prepare
  w = np.asarray(prepare(full, RLSpec())["weights"])
  loss = int(((w > 0) & full["loss_mask"]).sum())
  assert loss == 4 + 2                                   # group 1 is filtered
  t = StepTokens.from_arrays(full, loss=loss)
  assert (t.prompt, t.sampled, t.injected, t.loss, t.rescored) == (
      3 + 3 + 2 + 2, 4 + 2 + 3 + 1, 2, 6, 0)
  assert t.processed == 10 + 10 + 2 == 22
  assert t.padding == 4 * 32 - 22 == 106


def test_ledger_flops_hand_count():
  led = ComputeLedger(train_devices=1, gen_devices=1, params_active=N)
  full = _hand_batch()
  led.add_step(StepTokens.from_arrays(full, loss=6))
  assert led.train_flops == 6 * N * 22 == 132_000        # old ledger: 6 * N * 6 loss tokens
  assert led.gen_flops == 2 * N * 22 == 44_000           # old ledger: 2 * N * 10 sampled tokens
  assert led.train_loss_flops == 6 * N * 6 == 36_000
  assert led.train_pad_flops == 6 * N * 106 == 636_000
  # A step the parity gate re-scored: one more forward (2N) over its 22 tokens.
  led.add_step(StepTokens.from_arrays(full, loss=6, rescored=True))
  assert led.train_flops == 132_000 + 132_000 + 2 * N * 22 == 308_000
  assert led.gen_flops == 88_000 and led.train_loss_flops == 72_000
  snap = led.snapshot()
  assert (snap["train_flops"], snap["gen_flops"], snap["train_loss_flops"],
          snap["train_pad_flops"]) == (308_000, 88_000, 72_000, 1_272_000)
  # A skipped step (every group filtered: no loss token) still processed its tokens.
  led.add_step(StepTokens.from_arrays(full, loss=0))
  assert led.train_flops == 440_000 and led.train_loss_flops == 72_000


def test_ledger_flops_survive_resume():
  led = ComputeLedger(train_devices=1, gen_devices=1, params_active=N)
  led.add_step(StepTokens(prompt=3, sampled=4, injected=1, padding=2, loss=4))
  back = ComputeLedger.resume(led.state_dict(), count_gap=False)
  assert (back.train_flops, back.gen_flops, back.train_loss_flops, back.train_pad_flops) == (
      6 * N * 8, 2 * N * 8, 6 * N * 4, 6 * N * 2)
  old = {k: v for k, v in led.state_dict().items()
         if k not in ("train_loss_flops", "train_pad_flops")}       # a checkpoint from before
  assert ComputeLedger.resume(old, count_gap=False).train_loss_flops == 0.0
