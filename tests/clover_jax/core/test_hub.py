"""Hub ids (`clover_jax.core.hub`), offline, against a Hub cache the tests build in the Hub's own layout.

`build_hub_cache` writes what `huggingface_hub.snapshot_download` leaves behind:
`models--org--name/blobs/<hash>` holding the bytes, `snapshots/<commit>/<file>` as relative symlinks
into `blobs/`, `refs/<branch>` holding the commit, and optionally `trees/<commit>.json`, the cached
listing of every file of the repository at that commit. With `HF_HUB_OFFLINE` set, huggingface_hub
answers from that cache alone — and when the listing is cached it refuses a snapshot that lacks a
file the request's patterns select, which is how these tests see which files clover-jax asks for.
No test touches the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clover_jax import bundled_model_path
from clover_jax.core.hub import CheckpointNotFoundError, resolve_checkpoint

REPO = "tiny-org/tiny-clover"
BUNDLED = bundled_model_path()
# Files a real Qwen3.5/3.6 repository has besides the ones clover-jax reads; none may be requested.
UNREAD_FILES = ["README.md", ".gitattributes", "merges.txt", "vocab.json", "preprocessor_config.json",
                "video_preprocessor_config.json", "training_summary.json", "original/consolidated.safetensors"]


def build_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes], commit: str, refs: tuple[str, ...] = ("main",),
                    listed: list[str] | None = None) -> Path:
    """One commit of `repo_id` in the Hub cache `cache`; returns its snapshot directory. `listed`:
    the repository's files at that commit (the cached tree listing), when the test needs one."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    if listed is not None:
        entries = {name: {"size": len(files.get(name, b"")), "blob_id": hashlib.sha1(name.encode()).hexdigest()}
                   for name in listed}
        (repo / "trees").mkdir(exist_ok=True)
        (repo / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": entries}))
    return snapshot


def bundled_files(**replaced: dict) -> dict[str, bytes]:
    """The bundled checkpoint's files; `replaced` swaps a JSON file's fields (file stem -> fields)."""
    files = {path.name: path.read_bytes() for path in BUNDLED.iterdir() if path.is_file()}
    for stem, fields in replaced.items():
        files[f"{stem}.json"] = json.dumps({**json.loads(files[f"{stem}.json"]), **fields}).encode()
    return files


def sharded(files: dict[str, bytes]) -> dict[str, bytes]:
    """The same weights as two shards and an index (as large checkpoints are published)."""
    from safetensors.numpy import load, save

    tensors = load(files.pop("model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, members in shards.items():
        files[shard] = save({name: tensors[name] for name in members})
    weight_map = {name: shard for shard, members in shards.items() for name in members}
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return files


COMMIT_MAIN, COMMIT_V2 = "a" * 40, "b" * 40


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An offline Hub cache holding REPO at main (the bundled model) and at tag v2 (threshold 0.5).

    huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported; the environment
    variables themselves are exercised in a subprocess (test_cache_variables_...)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    build_hub_cache(cache, REPO, bundled_files(), COMMIT_MAIN)
    build_hub_cache(cache, REPO, bundled_files(generation_config={"threshold": 0.5}), COMMIT_V2, refs=("v2",))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_loads_model_generation_config_and_tokenizer_from_the_cache(offline_cache):
    from clover_jax import CloverModel
    from clover_jax.text.tokenizer import Tokenizer
    from decoding import GenerationConfig

    snapshot = offline_cache / "models--tiny-org--tiny-clover" / "snapshots" / COMMIT_MAIN
    model = CloverModel.from_pretrained(REPO, progress=False)
    local = CloverModel.from_pretrained(BUNDLED, progress=False)
    assert Path(model.path) == snapshot
    import jax

    assert all(np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(local.params), strict=True))
    assert GenerationConfig.from_pretrained(REPO) == GenerationConfig.from_pretrained(BUNDLED)
    messages = [{"role": "user", "content": "sort 3 1 2"}]
    assert Tokenizer.from_pretrained(REPO).apply_chat_template(messages, add_generation_prompt=True) == \
        Tokenizer.from_pretrained(BUNDLED).apply_chat_template(messages, add_generation_prompt=True)


def test_revision_picks_a_tag_or_a_commit(offline_cache):
    from decoding import GenerationConfig

    assert GenerationConfig.from_pretrained(REPO).threshold == 0.9
    assert GenerationConfig.from_pretrained(REPO, revision="v2").threshold == 0.5
    assert GenerationConfig.from_pretrained(REPO, revision=COMMIT_V2).threshold == 0.5
    assert resolve_checkpoint(REPO, revision="v2").name == COMMIT_V2
    with pytest.raises(CheckpointNotFoundError, match="'tiny-org/tiny-clover' at revision 'v3' is neither a local "
                                                      "directory nor in the Hub cache .*HF_HUB_OFFLINE=1"):
        GenerationConfig.from_pretrained(REPO, revision="v3")


def test_an_id_that_cannot_be_resolved_is_an_error_naming_it(offline_cache, tmp_path):
    from clover_jax import CloverModel
    from clover_jax.text.tokenizer import Tokenizer

    for load in (CloverModel.from_pretrained, Tokenizer.from_pretrained):
        with pytest.raises(CheckpointNotFoundError, match="'tiny-org/missing' is neither a local directory nor in "
                                                          "the Hub cache"):
            load("tiny-org/missing")
    with pytest.raises(CheckpointNotFoundError, match="checkpoint directory '/no/such/dir' does not exist"):
        resolve_checkpoint("/no/such/dir")  # a path, not an id: the Hub is not asked
    with pytest.raises(CheckpointNotFoundError, match="revision='v2' applies to Hub ids"):
        resolve_checkpoint(BUNDLED, revision="v2")


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(offline_cache, tmp_path, monkeypatch):
    from decoding import GenerationConfig

    local = tmp_path / "work" / REPO
    shutil.copytree(BUNDLED, local)
    (local / "generation_config.json").write_text(json.dumps(
        {**json.loads((BUNDLED / "generation_config.json").read_text()), "threshold": 0.7}))
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_checkpoint(REPO) == Path(REPO)
    assert GenerationConfig.from_pretrained(REPO).threshold == 0.7


def test_only_the_files_clover_jax_reads_are_requested(tmp_path, monkeypatch):
    """The cached listing names files clover-jax does not read (README, vocab.json, a stale
    single-file checkpoint beside the shards, ...) that the snapshot lacks: offline, huggingface_hub
    refuses a request whose patterns select any of them."""
    from huggingface_hub import constants

    from clover_jax import CloverModel

    files = sharded(bundled_files())
    del files["training_summary.json"]  # in the listing below, not in the snapshot
    cache = tmp_path / "hub"
    listing = sorted(files) + UNREAD_FILES + ["model.safetensors"]
    build_hub_cache(cache, REPO, files, COMMIT_MAIN, listed=listing)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = CloverModel.from_pretrained(REPO, progress=False)
    assert model.config.num_experts == 8
    # the same check notices a file clover-jax does read: drop a shard from the snapshot
    os.unlink(cache / "models--tiny-org--tiny-clover" / "snapshots" / COMMIT_MAIN / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointNotFoundError, match="Hub model 'tiny-org/tiny-clover' .*(lacks files|has no "
                                                      "model-00002-of-00002.safetensors)"):
        CloverModel.from_pretrained(REPO, progress=False)


def test_a_snapshot_without_a_config_is_not_a_checkpoint(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from decoding import GenerationConfig

    cache = tmp_path / "hub"
    build_hub_cache(cache, "tiny-org/not-a-model", {"README.md": b"# hi"}, COMMIT_MAIN)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointNotFoundError, match="Hub model 'tiny-org/not-a-model' has no config.json"):
        GenerationConfig.from_pretrained("tiny-org/not-a-model")


@pytest.mark.parametrize("variable", ["HF_HOME", "HF_HUB_CACHE"])
def test_cache_variables_and_offline_mode_are_honoured_by_the_cli(tmp_path, variable):
    home = tmp_path / "hf"
    cache = home / "hub" if variable == "HF_HOME" else tmp_path / "elsewhere"
    snapshot = build_hub_cache(cache, REPO, bundled_files(), COMMIT_MAIN)
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    env.update({variable: str(home if variable == "HF_HOME" else cache), "HF_HUB_OFFLINE": "1",
                "JAX_PLATFORMS": "cpu"})
    command = [sys.executable, "-m", "clover_jax", "info", REPO, "--json"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["path"] == str(snapshot) and record["parameters"]["total"] > 0
    missing = subprocess.run(command[:-2] + ["tiny-org/missing"], capture_output=True, text=True, env=env,
                             timeout=300)
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"clover-jax: error: 'tiny-org/missing' is neither a local directory nor in the Hub cache {cache} "
        "(HF_HUB_OFFLINE=1)"]


def test_a_bad_config_is_refused_before_any_weights_are_fetched(tmp_path, monkeypatch):
    """The snapshot lacks the weights its listing names: had from_pretrained asked for them, the
    error would be about missing files; it is about config.json, found first."""
    from huggingface_hub import constants

    from clover_jax import CloverModel, ConfigError

    files = bundled_files(config={"num_experts": "8"})
    del files["model.safetensors"]  # listed below, absent from the snapshot
    cache = tmp_path / "hub"
    build_hub_cache(cache, REPO, files, COMMIT_MAIN, listed=sorted(files) + ["model.safetensors"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="num_experts"):
        CloverModel.from_pretrained(REPO, progress=False)
