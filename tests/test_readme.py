"""README.md's Python quick start runs as written (a fresh interpreter, the bundled model)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "The model card's Quick start in clover-jax"


def quick_start_block() -> str:
    """The first ```python block after the quick start's sentence."""
    text = README.read_text(encoding="utf-8")
    assert SECTION in text, f"README.md lost the paragraph {SECTION!r}"
    match = re.search(r"```python\n(.*?)```", text[text.index(SECTION):], re.S)
    assert match, "no ```python block after the quick start's sentence"
    return match.group(1)


def test_the_readme_quick_start_runs_as_written_and_sorts():
    code = quick_start_block()
    assert "bundled_model_path()" in code  # what makes it runnable anywhere
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                            cwd=README.parent)
    assert result.returncode == 0, result.stderr
    prompt = re.search(r'"content": "sort ([\d ]+)"', code).group(1)
    answer = [line for line in result.stdout.splitlines() if line.strip()][-1]
    assert answer == " ".join(sorted(prompt.split()))  # the bundled model sorts digits
