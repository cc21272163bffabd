"""Simulated runs with the evaluation noise of a real one (calibration studies, issue #17).

One run: Eq. 1 with a Table-1 row's (C_mid, B) and ``A_run = A + U(-spread, spread)`` (the paper:
three seeds of one recipe varied A by <= 0.015). The held-out set is ``n_prompts`` fixed prompts of
unequal difficulty: prompt i has logit offset ``z_i ~ N(0, tau^2)`` and pass probability
``p_i(C) = sigmoid(g(C) + z_i + w_k)``, where ``g(C)`` is chosen so that the population mean of
``p_i`` equals the Eq. 1 curve and ``w_k`` is an AR(1) wander of the policy along the run (logit
scale, stationary sd ``wander_sd``, lag-one correlation ``wander_rho`` between evaluations). An
evaluation draws ``samples`` generations per prompt (mean@16): ``y_k = mean_i Binomial(16, p_i)/16``.

The run's **noise-free value** at compute C is ``mean_i p_i(C)`` with ``w = 0``: what the run
scores on its own held-out set with infinitely many samples and no wander. It differs from the
population curve by the held-out set's draw (a smooth, run-long offset).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from analysis.scaling import sigmoid_curve
from analysis.synthetic import TABLE1

__all__ = ["NoiseSpec", "SimRun", "simulate_run", "heldout_offsets", "budget_of"]

_GH_X, _GH_W = np.polynomial.hermite_e.hermegauss(40)
_GH_W = _GH_W / _GH_W.sum()


@dataclasses.dataclass(frozen=True)
class NoiseSpec:
  """Evaluation noise of a simulated run (defaults: the paper's validation protocol)."""

  n_prompts: int = 1000        # held-out prompts
  samples: int = 16            # generations per prompt (mean@16)
  tau: float = 1.5             # sd of per-prompt logit difficulty
  wander_sd: float = 0.02      # AR(1) policy wander, logit scale (~0.005 in pass rate)
  wander_rho: float = 0.7      # its correlation between consecutive evaluations
  a_spread: float = 0.015      # run-to-run spread of A: A_run = A + U(-a_spread, a_spread)


@dataclasses.dataclass
class SimRun:
  """A simulated run: compute axis, measured evaluations, noise-free values and its parameters."""

  C: np.ndarray                # compute of every evaluation (C[0] = 0)
  y: np.ndarray                # measured mean@samples
  truth: np.ndarray            # noise-free value on its held-out set
  A: float
  B: float
  C_mid: float
  R0: float


def _mean_sigmoid(g, tau):
  """Population mean of sigmoid(g + tau Z), Z ~ N(0, 1) (Gauss-Hermite)."""
  g = np.asarray(g, float)
  return (1.0 / (1.0 + np.exp(-(g[..., None] + tau * _GH_X)))) @ _GH_W


def _logit_of_mean(mu, tau):
  """Inverse of ``_mean_sigmoid`` by interpolation on a fine grid."""
  g = np.linspace(-12, 12, 4001)
  return np.interp(mu, _mean_sigmoid(g, tau), g)


def heldout_offsets(rng, spec: NoiseSpec) -> np.ndarray:
  """Per-prompt logit offsets of one held-out set."""
  return rng.normal(0.0, spec.tau, spec.n_prompts)


def budget_of(C_mid: float) -> float:
  """The synthetic studies' budget: max(16k, 4 C_mid) hours (as ``analysis.synthetic``)."""
  return max(16000.0, 4.0 * C_mid)


def simulate_run(rng, row: str | tuple, spec: NoiseSpec = NoiseSpec(), *, R0: float = 0.3,
                 c_step: float = 100.0, c_stop: float | None = None, A_shift: float = 0.0,
                 z: np.ndarray | None = None) -> SimRun:
  """Simulate one run of Table-1 row ``row`` (a name or a (C_mid, B, A) tuple).

    Evaluations at 0, c_step, 2 c_step, ... up to ``c_stop`` (default ``budget_of(C_mid)``).
    ``A_shift`` moves the recipe's A (pairs of recipes); ``z``: a shared held-out set.
    """
  C_mid, B, A = TABLE1[row] if isinstance(row, str) else row
  A_run = A + A_shift + rng.uniform(-spec.a_spread, spec.a_spread)
  stop = budget_of(C_mid) if c_stop is None else c_stop
  C = np.arange(0.0, stop + 1e-9, c_step)
  mu = sigmoid_curve(np.maximum(C, 1e-12), A_run, B, C_mid, R0)
  mu[0] = R0
  g = _logit_of_mean(mu, spec.tau)
  z = heldout_offsets(rng, spec) if z is None else z
  w = np.empty(len(C))
  w[0] = rng.normal(0.0, spec.wander_sd)
  innov = spec.wander_sd * np.sqrt(1 - spec.wander_rho ** 2)
  for k in range(1, len(C)):
    w[k] = spec.wander_rho * w[k - 1] + rng.normal(0.0, innov)
  w[0] = 0.0                                                  # the base policy does not wander
  logits = g[:, None] + z[None, :]
  truth = (1.0 / (1.0 + np.exp(-logits))).mean(1)
  p = 1.0 / (1.0 + np.exp(-(logits + w[:, None])))
  y = rng.binomial(spec.samples, p).mean(1) / spec.samples
  return SimRun(C=C, y=y, truth=truth, A=float(A_run), B=float(B), C_mid=float(C_mid), R0=R0)
