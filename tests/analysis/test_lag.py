"""analysis.lag: the run summary's lag histogram, mean lag and max kl_k3 from forced train lines,
and the figure beside the JSON."""
import json

import numpy as np

from analysis.lag import lag_summary, write_lag_summary


def test_lag_summary_totals_and_figure(tmp_path):
  lines = [dict(step=1, kind="train", lag_hist=[10], kl_k3=1e-4),
           dict(step=2, kind="train", lag_hist=[0, 6, 4], kl_k3=3e-2),
           dict(step=2, kind="eval", val_pass_rate=0.5, compute_hours=1.0),
           dict(step=3, kind="train", lag_hist=[0, 0, 0, 8], kl_k3=2e-3)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  s = lag_summary(tmp_path)
  assert s["lag_hist"] == [10, 6, 4, 8] and s["max_lag"] == 3 and s["steps"] == [1, 2, 3]
  assert s["mean_lag"] == (6 + 8 + 24) / 28
  np.testing.assert_allclose(s["mean_lag_per_step"], [0.0, 1.4, 3.0])
  assert s["max_kl_k3"] == 3e-2
  out = write_lag_summary(tmp_path, tmp_path / "fit")
  assert json.loads((tmp_path / "fit" / "lag.json").read_text()) == out
  assert (tmp_path / "fit" / "lag.png").read_bytes()[:4] == b"\x89PNG"
