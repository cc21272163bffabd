"""A CI-sized, fixed-seed version of `python -m analysis.calibrate` (issue #17; the 200-run tables are
in docs/ANALYSIS.md). Bounds are looser than the study's (30 runs: the binomial sd of a 90 % coverage
is 5.5 points) but still fail on a band that is too narrow, too wide or a verdict that never flips."""
import numpy as np
import pytest

from analysis.calibrate import coverage_study, identifiability_study, pairs_study

pytestmark = pytest.mark.slow


def test_band_coverage_on_simulated_runs():
  cov = coverage_study(30, seed=11)
  assert 0.76 <= cov["coverage_truth"] <= 1.0
  assert 0.76 <= cov["measurement_band_covers_measured"] <= 1.0
  assert cov["median_width"] < 0.04                 # not covering by being uninformative
  errs = [abs(r["pred"] - r["truth"]) for r in cov["runs"]]
  assert np.median(errs) < 0.01


def test_identifiability_verdict_flips_between_cmid_over_4_and_cmid():
  ident = identifiability_study(30, seed=12, ratios=(0.25, 1.0))
  share = ident["share_identifiable"]
  assert share["0.25"] <= 0.05 and share["1.0"] >= 0.85


def test_which_recipe_wins_probability_is_informative_and_calibrated():
  pairs = pairs_study(16, seed=13)
  p = np.array([x["p_first"] for x in pairs["pairs"]])
  w = np.array([x["first_wins"] for x in pairs["pairs"]], float)
  assert pairs["brier"] < 0.2                       # a coin flip scores 0.25
  assert abs(p.mean() - w.mean()) < 0.25
