"""notebooks/*.ipynb run end to end on the CPU path (the bundled tiny model), as CI runs them.

Each notebook is executed top to bottom in a fresh kernel with nbclient (`pytest --nbmake notebooks`
runs the same). `CLOVER_JAX_MODEL=DIR` points the notebooks at another checkpoint.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from clover_jax.api.cli import BUNDLED_MODEL

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["quickstart.ipynb", "decoding_schedules.ipynb", "finetune.ipynb"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_with_outputs_cleared(name):
    import nbformat

    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_end_to_end_on_cpu(name, monkeypatch, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    if not os.environ.get("CLOVER_JAX_MODEL") and not (BUNDLED_MODEL / "config.json").is_file():
        pytest.skip(f"the bundled model is not in this checkout yet ({BUNDLED_MODEL}); the notebooks run on it")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the kernel inherits the environment
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CLOVER_JAX_FIGURES", str(tmp_path))  # the figures in docs/ are not rewritten by tests
    monkeypatch.setenv("CLOVER_JAX_WORK", str(tmp_path / "work"))  # the fine-tuning run's data and outputs
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    started = time.perf_counter()
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    print(f"{name}: {time.perf_counter() - started:.0f} s")
    errors = [output for cell in notebook.cells for output in cell.get("outputs", []) if output.output_type == "error"]
    assert not errors
