"""The Colab-ready notebook executes headless on the shipped example runs."""

import json
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]
NB = REPO / "analysis" / "notebooks" / "scaling_curves.ipynb"


def test_notebook_executes(tmp_path, monkeypatch):
  nb = nbformat.read(NB, as_version=4)
  assert "'google.colab' in sys.modules" in nb.cells[2].source          # Colab install cell
  # Pin the kernel to this interpreter (the venv's): a "python3" spec on JUPYTER_PATH, which jupyter
  # searches before any user-level or system spec.
  spec = tmp_path / "kernels" / "python3"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
    "display_name": "Python 3 (test venv)", "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  before = sorted(p.name for p in NB.parent.iterdir())
  NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NB.parent)}}).execute()
  assert sorted(p.name for p in NB.parent.iterdir()) == before            # writes nothing into the repo
  outs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outs if o.get("output_type") == "error"]
  text = "\n".join(o.get("text", "") for o in outs)
  assert f"python: {sys.executable}" in text
  assert "A = " in text and "95% CI" in text and "final (" in text and "power law: A = " in text
  assert "P(highest at the budget): scalerl" in text and "after 700 h: not yet identifiable" in text
  assert sum("image/png" in o.get("data", {}) for o in outs) >= 4
  md = [o["data"]["text/markdown"] for o in outs if "text/markdown" in o.get("data", {})]
  assert any("higher B wins: scalerl" in m for m in md) and any("higher A wins: batch_2048" in m for m in md)
