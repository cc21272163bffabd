"""The buffer's evaluation lane (docs/ROLLOUT.md "Evaluation through the fleet"): open evaluations
pinned to a policy version, leased to generators that hold that version ahead of training leases,
their per-group results, and the last few collected answers (a retried CollectEval gets the same).

Not in the WAL: a buffer restart loses open evaluations (the learner resubmits). Not locked by
itself: `BufferState` owns the lock and calls every method with it held; this object keeps the
lane's own bookkeeping and rules, BufferState the waiting, the clock and the generators' holdings.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Optional, Sequence

from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import validation as val

KEEP_COLLECTED = 4          # collected answers kept for a retried CollectEval


@dataclasses.dataclass
class EvalJob:
  """An open evaluation: one group per held-out prompt, pinned to `req.version`."""
  req: pb.EvalRequest              # the request as sent (its prompts are re-sent in assignments)
  prompts: list                    # list[val.EvalPromptView]
  todo: collections.deque          # group indices not leased (front: expired ones, re-leased first)
  leased: dict = dataclasses.field(default_factory=dict)    # index -> (generator_id, expires_at)
  results: dict = dataclasses.field(default_factory=dict)   # index -> pb.EvalGroupResult
  held: bool = False               # a generator holding the version was told to keep it
  superseded_at: Optional[float] = None   # first seen older than the newest published version

  @property
  def complete(self) -> bool:
    return len(self.results) == len(self.prompts)

  def state(self, **kw) -> pb.EvalResult:
    """An incomplete answer (pending groups, held)."""
    return pb.EvalResult(eval_id=self.req.eval_id, version=self.req.version, complete=False,
                         pending_groups=len(self.prompts) - len(self.results), held=self.held, **kw)


class EvalLane:
  """Open evaluations by id (insertion = submission order) and the last collected answers."""

  def __init__(self, limits: val.Limits, lease_ttl_s: float):
    self.limits, self.lease_ttl_s = limits, lease_ttl_s
    self.jobs: dict[int, EvalJob] = {}
    self.done: collections.OrderedDict = collections.OrderedDict()

  # ---- submission ----------------------------------------------------------------------------------
  def known(self, eval_id: int) -> Optional[pb.EvalAck]:
    """The duplicate ack of an evaluation already submitted, else None after checking there is
    room for one more (RESOURCE_EXHAUSTED)."""
    if eval_id in self.jobs or eval_id in self.done:
      job = self.jobs.get(eval_id)
      n = len(job.prompts) if job is not None else len(self.done[eval_id].results)
      return pb.EvalAck(eval_id=eval_id, groups=n, duplicate=True)
    if len(self.jobs) >= self.limits.max_open_evals:
      raise val.exhausted(f"{len(self.jobs)} evaluations open (limit "
                          f"{self.limits.max_open_evals}); collect or cancel some first")
    return None

  def open(self, req: pb.EvalRequest, prompts: list) -> bool:
    """Opens a validated request; False when a concurrent submit of the same id got there first."""
    if req.eval_id in self.jobs:
      return False
    self.jobs[req.eval_id] = EvalJob(req, prompts, collections.deque(range(len(prompts))))
    return True

  def versions(self) -> list[int]:
    """Versions pinned by open evaluations (generators keep those weights)."""
    return sorted({job.req.version for job in self.jobs.values()})

  # ---- leases ------------------------------------------------------------------------------------
  def take(self, generator_id: str, max_groups: int, held: set, now: float) -> list[pb.Assignment]:
    """Up to `max_groups` unleased groups of the oldest open evaluation pinned to a held version;
    marks every open evaluation of a held version `held`."""
    out = []
    for eid, job in self.jobs.items():
      if job.req.version not in held:
        continue
      job.held = True
      if out or not job.todo:
        continue
      r = job.req
      while job.todo and len(out) < max_groups:
        i = job.todo.popleft()
        job.leased[i] = (generator_id, now + self.lease_ttl_s)
        p = job.prompts[i]
        out.append(pb.Assignment(
            group_id=i, prompt_id=p.prompt_id, prompt_tokens=r.prompts[i].prompt_tokens,
            answer=p.answer, group_size=r.samples_per_prompt, min_version=r.version,
            max_version=r.version, lease_expires_unix_s=now + self.lease_ttl_s, eval_id=eid,
            eval_seed=r.seed, temperature=r.temperature, top_p=r.top_p, task=p.task))
    return out

  def expire(self, now: float) -> None:
    """Leases that ran out go back to the front of their evaluation, in group order (evaluation
    chunks stay aligned)."""
    for job in self.jobs.values():
      gone = sorted(i for i, (_, exp) in job.leased.items() if exp < now)
      for i in gone:
        del job.leased[i]
      job.todo.extendleft(reversed(gone))

  def renew(self, generator_id: str, now: float) -> int:
    """A heartbeat: extends the generator's evaluation leases; returns how many."""
    n = 0
    for job in self.jobs.values():
      for i, (gen, _) in list(job.leased.items()):
        if gen == generator_id:
          job.leased[i] = (gen, now + self.lease_ttl_s)
          n += 1
    return n

  def superseded(self, version: int, now: float) -> None:
    """`version` was published: older evaluations start their supersession clock."""
    for job in self.jobs.values():
      if job.req.version < version and job.superseded_at is None:
        job.superseded_at = now

  def unservable(self, job: EvalJob, version: int,
                 holders: Mapping[str, tuple[frozenset, float]], now: float) -> bool:
    """The evaluation can never complete: its version is no longer the newest published (a
    generator cannot fetch it any more), has not been for a lease TTL, and no generator that
    reported within a lease TTL holds it (every one that had it restarted, or none fetched it). A
    live holder reports at every lease and heartbeat, well inside a TTL."""
    if job.req.version >= version:
      job.superseded_at = None
      return False
    if job.superseded_at is None:
      job.superseded_at = now
    if now - job.superseded_at < self.lease_ttl_s:
      return False
    return not any(job.req.version in held for held, t in holders.values()
                   if now - t <= self.lease_ttl_s)

  # ---- results -----------------------------------------------------------------------------------
  def add_results(self, results: Sequence[pb.EvalGroupResult]) -> pb.EvalPushResponse:
    """Stores results all-or-nothing (validation.validate_eval_result); a group already reported
    counts as a duplicate. Unknown (collected, cancelled, lost) evaluations are
    FAILED_PRECONDITION."""
    plan, dup, seen = [], 0, set()
    for r in results:
      job = self.jobs.get(r.eval_id)
      if job is None:
        if r.eval_id in self.done:
          dup += 1
          continue
        raise val.precondition(f"evaluation {r.eval_id} is not open (collected, cancelled or "
                               f"lost in a buffer restart)")
      if not 0 <= r.group_id < len(job.prompts):
        raise val.invalid(f"eval {r.eval_id}: group_id {r.group_id} out of range "
                          f"[0, {len(job.prompts)})")
      if r.group_id in job.results or (r.eval_id, r.group_id) in seen:
        dup += 1
        continue
      if r.group_id in job.todo:
        raise val.precondition(f"eval {r.eval_id} group {r.group_id} is not leased")
      val.validate_eval_result(r, version=job.req.version, samples=job.req.samples_per_prompt,
                               prompt_id=job.prompts[r.group_id].prompt_id, limits=self.limits)
      seen.add((r.eval_id, r.group_id))
      plan.append((job, r))
    for job, r in plan:
      job.leased.pop(r.group_id, None)
      job.results[r.group_id] = r
    return pb.EvalPushResponse(accepted=len(plan), duplicate=dup)

  def collect(self, eval_id: int, cancel: bool) -> Optional[pb.EvalResult]:
    """A final answer now (complete: closed and kept; cancelled: dropped), or None while the
    evaluation is open and incomplete. NOT_FOUND for an id never submitted (or lost)."""
    done = self.done.get(eval_id)
    if done is not None:
      return done
    job = self.jobs.get(eval_id)
    if job is None:
      raise val.not_found(f"evaluation {eval_id} is not open (never submitted, or lost in a "
                          f"buffer restart: resubmit it)")
    if cancel:
      del self.jobs[eval_id]
      return job.state()
    if not job.complete:
      return None
    del self.jobs[eval_id]
    out = pb.EvalResult(eval_id=eval_id, version=job.req.version, complete=True, held=job.held,
                        results=[job.results[i] for i in range(len(job.prompts))])
    self.done[eval_id] = out
    while len(self.done) > KEEP_COLLECTED:
      self.done.popitem(last=False)
    return out
