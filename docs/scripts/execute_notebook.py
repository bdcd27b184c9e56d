"""Runs a notebook top to bottom and saves it with its outputs, stamped with a digest of its code cells
(the test suite checks that the saved outputs come from the code the notebook holds).

  QUICKSTART_DEFAULT_JOB=1 python docs/scripts/execute_notebook.py notebooks/quickstart.ipynb
"""
import hashlib
import os
import sys

import nbclient
import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def code_digest(nb) -> str:
  """SHA-256 of the notebook's code cells, in order (outputs and markdown left out)."""
  return hashlib.sha256("\n\0".join(c.source for c in nb.cells if c.cell_type == "code").encode()).hexdigest()


def main(path: str) -> None:
  nb = nbformat.read(path, as_version=4)
  os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
  nbclient.NotebookClient(nb, timeout=3600, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
  nb.metadata["dapo_jax"] = {"code_sha256": code_digest(nb),
                             "environment": {k: v for k, v in os.environ.items() if k.startswith("QUICKSTART_")}}
  nbformat.write(nb, path)


if __name__ == "__main__":
  main(sys.argv[1])
