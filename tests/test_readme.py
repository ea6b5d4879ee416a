"""README.md's Python quick start runs as written (a fresh interpreter, the bundled model)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "The model card's Quick start in clover-jax"
HISTORY_SECTION = "Replaying a block from its history"


def python_block_after(sentence: str) -> str:
    """The first ```python block after `sentence`."""
    text = README.read_text(encoding="utf-8")
    assert sentence in text, f"README.md lost the paragraph {sentence!r}"
    match = re.search(r"```python\n(.*?)```", text[text.index(sentence):], re.S)
    assert match, f"no ```python block after {sentence!r}"
    return match.group(1)


def run_sorting_example(code: str) -> list[str]:
    """Run `code` in a fresh interpreter; check its last line is the sorted prompt; its output lines."""
    assert "bundled_model_path()" in code  # what makes it runnable anywhere
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                            cwd=README.parent)
    assert result.returncode == 0, result.stderr
    prompt = re.search(r'"content": "sort ([\d ]+)"', code).group(1)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[-1] == " ".join(sorted(prompt.split()))  # the bundled model sorts digits
    return lines


def test_the_readme_quick_start_runs_as_written_and_sorts():
    run_sorting_example(python_block_after(SECTION))


def test_the_readme_history_replay_runs_and_its_last_frame_holds_the_answer():
    lines = run_sorting_example(python_block_after(HISTORY_SECTION))
    frames = [line for line in lines[:-1] if line.startswith("block ")]
    assert len(frames) >= 2 and frames[0].startswith("block 0 step 0:")
    assert "░" in frames[0]  # fixed_k fills two positions per step: the first frame is still partly masked
    assert lines[-1] in frames[-1].split(":", 1)[1]  # the replay ends on the answer
