"""The quickstart notebook executes top to bottom on CPU."""
import os

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_executes():
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
  env = {"QUICKSTART_SFT_STEPS": "30", "QUICKSTART_RL_STEPS": "2", "XLA_FLAGS": "", "PYTHONPATH": ROOT}
  old = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "Held-out before RL" in outputs and "parameters" in outputs
  assert any(o.get("output_type") == "display_data" for c in nb.cells for o in c.get("outputs", []))
