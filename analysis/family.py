"""Family pooling: forecast a run of a new recipe or allocation from finished runs of *other* ones
(issue #48; docs/ANALYSIS.md "Family pooling and allocation").

Runs of other recipes on the same model, data, evaluation and base policy share the shape of their
curves, not their bias or asymptote. The model (declared before its held-out runs ran):

1. every finished member is fitted alone (least-squares Eq. 1 on its whole curve): A_i, B_i and
   m_i = C_mid,i / T_i, its bend relative to its budget T_i (its last x);
2. the family: log B ~ N(mu_b, tau_b^2), log m ~ N(mu_m, tau_m^2), A ~ N(mu_A, tau_A^2), each
   centre the members' median and each spread 1.4826 x their MAD, floored (``FLOORS``);
3. the target is fitted by ``analysis.posterior`` with that prior (``fit_posterior(prior=...)``,
   C_mid's centre = m x the target's budget): its A is shrunk toward the family's only as far as
   its own data leave A undetermined;
4. the drift and bias: each member forecast by 1-3 with the family less itself, from the same
   extrapolation distance as the target, to its end; the residuals calibrate the target as a
   reference's do (``analysis.reference.calibrate``). With same-setup references too, the
   references' residuals (their forecasts pooled by the same family) are used instead.

Opt-in since the third round (declared, then worse on the held-out allocation runs; docs/ANALYSIS.md):
``family_prior(z=...)`` predicts the target's shape from its allocation knobs (``knobs_of``, slopes by
``ridge``) for an allocation the family never ran.

``setup_of`` / ``check_family``: what a family must share (model, data, evaluation, base policy);
a member that differs is refused by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shlex
from typing import Sequence

import numpy as np

from analysis.errors import AnalysisError, ForecastInputError
from analysis.metrics import CONFIG_FILE, RunData
from analysis.posterior import MIN_EVALS
from analysis.scaling import fit_sigmoid

__all__ = ["FLOORS", "MIN_MEMBERS", "KNOBS", "RIDGE", "config_of", "MemberFit", "member_fit", "fit_members", "robust_normal",
           "family_prior", "setup_of", "check_family", "NotIdentifiableError", "allocation_of", "knobs_of", "ridge"]

#: Floors of the family's spreads (sd of log B, of log m, of A): a family of identical shapes still
#: leaves the target some room (declared with the model).
FLOORS = {"log_b": 0.1, "log_m": 0.1, "A": 0.02}
#: Fewest fitted members a family prior is built from.
MIN_MEMBERS = 3
#: the knobs of an allocation (z = their log2), in order: rollouts per step, per prompt, thinking budget
KNOBS = ("batch", "rollouts", "think")
#: ridge penalty on the slopes of a regression on z (log2 units): a knob the family never varies keeps slope 0
RIDGE = 0.1
#: Where the B prior of ``analysis.posterior`` ends; a member fit at its edge has no B to pool.
_MAD_TO_SD = 1.4826


class NotIdentifiableError(AnalysisError):
  """A run too short (or too flat) for the family model to say anything; the message says why."""


@dataclasses.dataclass(frozen=True)
class MemberFit:
  """One finished member's Eq. 1 fit on its whole curve: A, B and m = C_mid / T (T: its last x)."""
  name: str
  A: float
  B: float
  m: float
  T: float
  n: int
  z: tuple | None = None     # log2 of its allocation's knobs (``KNOBS``); None when its config is unknown


def member_fit(run: RunData) -> MemberFit:
  """Least-squares Eq. 1 (``analysis.scaling.fit_sigmoid``) on the member's whole curve; a member
    too short or with no rise raises ``NotIdentifiableError`` naming it and the reason."""
  C, y = run.window()
  if len(C) < MIN_EVALS + 1:
    raise NotIdentifiableError(f"family member {run.name}: not identifiable, {len(C)} evaluations after "
                               f"step 0 (a member's whole-curve fit needs at least {MIN_EVALS + 1})")
  if not np.max(y) > run.r0:
    raise NotIdentifiableError(f"family member {run.name}: not identifiable, its pass rate never rises "
                               f"above R0 = {run.r0:.4g}")
  try:
    fit = fit_sigmoid(C, y, run.r0)
  except AnalysisError as e:
    raise NotIdentifiableError(f"family member {run.name}: not identifiable, Eq. 1 does not fit ({e})") from None
  assert fit.C_mid is not None          # an Eq. 1 fit always has one
  return MemberFit(run.name, float(fit.A), float(fit.B), float(fit.C_mid) / float(C[-1]), float(C[-1]), len(C))


def fit_members(runs: Sequence[RunData], cache: dict | None = None,
                knobs: bool = False) -> tuple[list[MemberFit], list[str]]:
  """Each member's ``member_fit`` (cached by name, run_dir and length) and the reasons of those left
    out (not identifiable); ``knobs``: with each member's allocation knobs (``knobs_of``, read from
    its config) in ``MemberFit.z``."""
  fits, skipped = [], []
  for r in runs:
    key = ("member", r.name, r.run_dir, len(r.compute), float(r.compute[-1]), knobs)
    if cache is not None and key in cache:
      got = cache[key]
    else:
      try:
        got = member_fit(r)
        if knobs:
          got = dataclasses.replace(got, z=knobs_of(r.run_dir or ""))
      except NotIdentifiableError as e:
        got = str(e)
      if cache is not None:
        cache[key] = got
    (fits if isinstance(got, MemberFit) else skipped).append(got)
  return fits, skipped


def robust_normal(x, floor: float) -> tuple[float, float]:
  """(median, max(1.4826 x MAD, floor)) of ``x``: a normal that one odd member cannot stretch."""
  x = np.asarray(x, float)
  med = float(np.median(x))
  return med, max(_MAD_TO_SD * float(np.median(np.abs(x - med))), floor)


def family_prior(fits: Sequence[MemberFit], budget: float, *, exclude: str | None = None,
                 z=None, exclude_z=None) -> dict:
  """The family's prior for a run forecast at ``budget`` (same axis as the members' T): Gaussians
    (mean, sd) on log C_mid (= log m + log budget), log B and A, for ``fit_posterior(prior=...)``;
    ``exclude``: a member left out (a member forecast by the family less itself); ``exclude_z``: the
    members of that allocation left out too.

    ``z``: the target's knobs (``knobs_of``). When the members' and the target's allocations are
    known and not all equal (issue #48, third round, declared before its held-out test, where it did
    worse than the pooled prior: opt-in, ``forecast_run(knobs=True)``): the slopes
    of log m, log B and A on z come from a ridge regression over the members (``ridge``); each
    member's (log m, log B, A) is moved along them to the target's knobs, and the moved values are
    pooled as before (median, 1.4826 x MAD, floored), their variance plus the slopes' own (the
    regression's ``res_var * (x G x - 1/n)`` at the target): the target's shape is predicted from its
    own knobs. Otherwise (all alike, or a knob unknown) the pooled prior exactly as before."""
  use = [f for f in fits if f.name != exclude and (exclude_z is None or f.z != tuple(exclude_z))]
  if len(use) < MIN_MEMBERS:
    raise ForecastInputError(f"a family needs at least {MIN_MEMBERS} members whose whole curve can be "
                             f"fitted, got {len(use)}; add finished runs of other recipes on the same setup")
  theta = np.column_stack([np.log([f.m for f in use]), np.log([f.B for f in use]), [f.A for f in use]])
  extra = np.zeros(3)
  zs = [f.z for f in use]
  how = "pooled"
  known = [tuple(q) for q in zs if q is not None]
  if z is not None and len(known) == len(zs) and len(set(known) | {tuple(z)}) > 1:
    Z, zt = np.array(known, float), np.asarray(z, float)
    reg = ridge(Z, theta)
    theta = theta + (zt[None, :] - Z) @ reg["beta"][1:]
    x = np.concatenate([[1.0], zt])
    extra = reg["res_var"] * max(float(x @ reg["G"] @ x) - 1.0 / len(use), 0.0)
    how = "knobs"
  (mu_m, sd_m), (mu_b, sd_b), (mu_a, sd_a) = (
    (mu, math.sqrt(sd * sd + float(e))) for (mu, sd), e in
    zip((robust_normal(theta[:, k], FLOORS[f]) for k, f in enumerate(("log_m", "log_b", "A"))), extra))
  return {"log_cmid": (mu_m + math.log(float(budget)), sd_m), "log_b": (mu_b, sd_b), "A": (mu_a, sd_a),
          "n": len(use), "m": math.exp(mu_m), "B": math.exp(mu_b), "shape": how}


def ridge(Z, T, lam: float = RIDGE) -> dict:
  """Ridge regression of each column of ``T`` (rows: runs or allocations) on [1, ``Z``] (penalty
    ``lam`` on the slopes, none on the intercept): {beta, G = (X'X + P)^-1, res_var (residual
    variance per column, dof = rows - rank X, at least 1), dof}. The prediction variance at x is
    ``res_var * (1 + x G x)``."""
  Z = np.atleast_2d(np.asarray(Z, float))
  T = np.asarray(T, float)
  X = np.hstack([np.ones((len(Z), 1)), Z])
  P = np.diag([0.0] + [float(lam)] * Z.shape[1])
  G = np.linalg.inv(X.T @ X + P)
  beta = G @ X.T @ T
  dof = max(len(Z) - np.linalg.matrix_rank(X), 1)
  return {"beta": beta, "G": G, "res_var": np.sum((T - X @ beta) ** 2, axis=0) / dof, "dof": dof}


def allocation_of(config) -> dict:
  """(batch size, rollouts per prompt, thinking budget) of a run config: rollouts per step, per
    prompt, and the middle of ``[think_budget_min, think_budget_max]``."""
  r = config.rollout
  return {"batch": int(r.prompts_per_step) * int(r.generations_per_prompt),
          "rollouts": int(r.generations_per_prompt),
          "think": 0.5 * (int(r.think_budget_min) + int(r.think_budget_max))}


def knobs_of(run_dir: str, config=None) -> tuple | None:
  """log2 of the run's allocation knobs (``KNOBS``, from ``config`` or its stored config); None when
    its config is unknown or does not load."""
  try:
    c = config if config is not None else (config_of(run_dir) if run_dir else None)
    if c is None:
      return None
    a = allocation_of(c)
    return tuple(float(math.log2(a[k])) for k in KNOBS)
  except Exception:   # a config that no longer loads: the pooled prior, as for an unknown one
    return None


# --- what a family must share -------------------------------------------------------------------

#: model fields that are numerics or implementation, a recipe's choice (the FP32 head is one), not
#: which model: runs that differ in them pool
_MODEL_NUMERICS = ("dtype", "param_dtype", "fp32_lm_head", "head_precision", "remat", "scan_layers",
                   "attention_impl", "attention_block", "attention_q_block", "logits_chunk", "moe_impl")
#: evaluation fields of config.eval (the schedule, timeout and where it runs are not what it measures)
_EVAL_FIELDS = ("samples_per_prompt", "temperature", "top_p", "num_prompts")


def _base_id(run_dir: str, name: str) -> str | None:
  """The base policy a run started from: a digest of its WORKDIR/base_policy files (weights and
    config, not ``sft_info.json``), or the base a
    stored real run names (``analysis.real_runs.base_of``); None when unknown."""
  bp = os.path.join(run_dir, "base_policy")
  if os.path.isdir(bp):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(bp)):
      for f in sorted(files):
        if f == "sft_info.json":     # how it was made (timings, cached or not), not the weights
          continue
        p = os.path.join(root, f)
        h.update(os.path.relpath(p, bp).encode())
        with open(p, "rb") as fh:
          h.update(fh.read())
    return "sha256:" + h.hexdigest()[:16]
  from analysis import real_runs   # local: real_runs names the stored runs' bases (imports tqdm)
  return real_runs.base_of(name)


def config_of(run_dir: str):
  """The run's config: WORKDIR/config.json, or a stored real run's command.txt (config file +
    overrides, loaded as ``scalerl_jax.main`` does); None when neither is there."""
  from scalerl_jax import config   # local: loading a run config loads its libraries' checks
  cfg = os.path.join(run_dir, CONFIG_FILE)
  if os.path.isfile(cfg):
    return config.resolve_config(cfg)
  cmd = os.path.join(run_dir, "command.txt")
  if os.path.isfile(cmd):
    args = shlex.split(open(cmd).read())
    spec = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
    if spec is None:
      return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return config.resolve_config(os.path.join(root, spec), config.split_overrides(args)[1])
  return None


def setup_of(run_dir: str, name: str | None = None, config=None) -> dict | None:
  """What a family must share, of the run in ``run_dir`` (``config``: its config when known, e.g.
    in training): {model, data, evaluation, base policy}; None when the run names no config."""
  run_dir = str(run_dir)
  name = name or os.path.basename(os.path.normpath(run_dir))
  try:
    c = config if config is not None else config_of(run_dir)
  except Exception as e:   # a config that no longer loads (a field since removed): say which
    raise ForecastInputError(f"{name}: its config does not load ({' '.join(str(e).split())[:200]})") from None
  if c is None:
    return None
  ev = {k: c.eval[k] for k in _EVAL_FIELDS}
  ev["answer_budget"] = c.rollout.answer_budget
  model = {k: v for k, v in c.model.to_dict().items() if k not in _MODEL_NUMERICS}
  return {"model": json.loads(json.dumps(model, default=str)),
          "data": json.loads(json.dumps(c.data.to_dict(), default=str)),
          "evaluation": json.loads(json.dumps(ev, default=str)),
          "base policy": _base_id(run_dir, name) or "sft:" + json.dumps(c.sft.to_dict(), sort_keys=True, default=str),
          "think_budget": [c.rollout.think_budget_min, c.rollout.think_budget_max]}


def _first_difference(a, b, path="") -> str | None:
  if isinstance(a, dict) and isinstance(b, dict):
    for k in sorted(set(a) | set(b)):
      d = _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
      if d:
        return d
    return None
  return None if a == b else f"{path}: {a!r} vs {b!r}"


def check_family(target: tuple[str, dict | None], members: Sequence[tuple[str, dict | None]]) -> dict:
  """Refuses, by name, a member whose model, data, evaluation or base policy differs from the
    target's (``setup_of``), or whose setup cannot be told. Returns {eval_budget_differs: names of
    members with another thinking budget (an allocation knob that also sets the evaluation's)}."""
  tname, tsetup = target
  if tsetup is None:
    raise ForecastInputError(f"{tname}: cannot tell its model, data, evaluation and base policy (no "
                             f"{CONFIG_FILE} or command.txt in its directory); a family needs them")
  differs = []
  for name, s in members:
    if s is None:
      raise ForecastInputError(f"family member {name}: cannot tell its model, data, evaluation and base "
                               f"policy (no {CONFIG_FILE} or command.txt); refused")
    for part in ("model", "data", "evaluation", "base policy"):
      d = _first_difference(tsetup[part], s[part], part)
      if d:
        raise ForecastInputError(f"family member {name} differs from {tname} in its {part} ({d}); "
                                 "a family shares model, data, evaluation and base policy - refused")
    if s["think_budget"] != tsetup["think_budget"]:
      differs.append(name)
  return {"eval_budget_differs": differs}
