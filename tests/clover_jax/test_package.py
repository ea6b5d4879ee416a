"""What `import clover_jax` offers: the user's names, each imported on first use, so the import
itself (and the CLI's argument checks) stays free of jax."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tokenizer_is_importable_beside_clover_model_and_import_clover_jax_stays_free_of_jax():
    code = """
import sys
import clover_jax
assert "jax" not in sys.modules, "import clover_jax imported jax"
assert {"Tokenizer", "CloverModel"} <= set(clover_jax.__all__) <= set(dir(clover_jax))
from clover_jax import Tokenizer
from clover_jax.text.tokenizer import Tokenizer as Home
assert Tokenizer is Home
tokenizer = Tokenizer.from_pretrained(clover_jax.bundled_model_path())
assert tokenizer.decode(tokenizer.encode("sort 3 1 2")) == "sort 3 1 2"
assert "jax" not in sys.modules, "the tokenizer imported jax"
from clover_jax import CloverModel
from clover_jax.model.clover_model import CloverModel as ModelHome
assert CloverModel is ModelHome
print("ok")
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
