"""Where a checkpoint is: a local directory, or a Hugging Face Hub id resolved to a local snapshot.

`resolve_checkpoint(name_or_path, revision=None, weights=False) -> Path` is the one place that
turns what a user passes to `from_pretrained` (or the CLI's `--model`) into a directory:

  * an existing local directory always wins, even when its name also reads as a Hub id
    ("org/name" relative to the working directory);
  * otherwise a Hub id ("org/name", optionally `revision=` a branch, tag or commit) goes through
    `huggingface_hub.snapshot_download`, which keeps the Hub's cache layout
    (`models--org--name/snapshots/<commit>/...`) and honours `HF_HUB_OFFLINE=1`, `HF_HOME`,
    `HF_HUB_CACHE` and `HF_TOKEN` as every Hugging Face library does;
  * only the files clover-jax reads are fetched: the small files (`SMALL_FILES`) always, and with
    `weights=True` the safetensors index and the shards it names (or the single
    `model.safetensors`). The small files come first, so a bad `config.json` is reported before
    tens of gigabytes are downloaded.

An Orbax directory (`weights.convert_to_orbax`) is local only. Anything that cannot be resolved
is a `CheckpointNotFoundError` (a `ValueError`) naming what was asked for.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from clover_jax.core.json_fields import read_json_object

logger = logging.getLogger(__name__)

# Everything clover-jax reads besides the weights: the model and generation configs, and what
# `clover_jax.text.tokenizer.Tokenizer` reads (special_tokens_map.json only for legacy tokenizers).
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "additional_chat_templates/*.jinja")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LIBRARY_NAME = "clover-jax"


class CheckpointNotFoundError(ValueError):
    """A checkpoint that is neither a local directory nor a Hub id that can be resolved."""


def resolve_checkpoint(name_or_path: str | os.PathLike, revision: str | None = None, weights: bool = False,
                       require: tuple[str, ...] = ()) -> Path:
    """The local directory holding the checkpoint `name_or_path` (a directory or a Hub id).

    revision: a branch, tag or commit of a Hub id (default: the repository's main branch); it
        does not apply to a local directory.
    weights: also fetch the safetensors files (a Hub id only; a local directory is returned as
        it is and its files are checked by the loader).
    require: files a Hub snapshot must hold (a local directory's files are the caller's to check).
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise CheckpointNotFoundError(f"a checkpoint is a directory or a Hub id such as 'org/name', got "
                                      f"{type(name_or_path).__name__}")
    if revision is not None and not isinstance(revision, str):
        raise CheckpointNotFoundError(f"revision must be a string (branch, tag or commit), got {revision!r}")
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise CheckpointNotFoundError(f"revision={revision!r} applies to Hub ids, but {name!r} is a local "
                                          "directory")
        return path
    if path.exists():
        raise CheckpointNotFoundError(f"{name!r} is not a directory (a checkpoint is a directory with config.json, "
                                      "model.safetensors and tokenizer.json, or a Hub id such as 'org/name')")
    if not is_hub_id(name):
        raise CheckpointNotFoundError(f"checkpoint directory {name!r} does not exist")
    return _from_hub(name, revision, weights, require)


def is_hub_id(name: str) -> bool:
    """Whether `name` is spelled as a Hub model id ("org/name" or a bare "name")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "/", "~")) or os.sep != "/" and os.sep in name:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _from_hub(repo_id: str, revision: str | None, weights: bool, require: tuple[str, ...]) -> Path:
    folder = _snapshot(repo_id, revision, list(SMALL_FILES) + ([INDEX_FILE] if weights else []))
    required = list(require)
    if weights:
        files = _weight_files(folder)
        # Pin the commit the small files came from, so config and weights always match.
        folder = _snapshot(repo_id, folder.name, files, shown_revision=revision, weights=True)
        required += files
    missing = [file for file in required if not (folder / file).is_file()]
    if missing:
        from huggingface_hub import constants

        where = "in the Hub cache (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "on the Hub"
        at = f" at revision {revision!r}" if revision else ""
        raise CheckpointNotFoundError(f"Hub model {repo_id!r}{at} has no {', '.join(missing[:3])}"
                                      f"{' ...' if len(missing) > 3 else ''} {where}: not a clover-jax checkpoint "
                                      f"({folder})")
    return folder


def _weight_files(folder: Path) -> list[str]:
    """The shards the index names (or the single file); a malformed index is left to the loader to report."""
    index = folder / INDEX_FILE
    if not index.is_file():
        return [SINGLE_FILE]
    try:
        weight_map = read_json_object(index).get("weight_map")
    except (OSError, ValueError):  # ConfigError is a ValueError
        return []
    if not isinstance(weight_map, dict):
        return []
    return sorted({file for file in weight_map.values() if isinstance(file, str)})


def _snapshot(repo_id: str, revision: str | None, patterns: list[str], shown_revision: str | None = None,
              weights: bool = False) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    shown_revision = shown_revision if weights else revision
    at = f" at revision {shown_revision!r}" if shown_revision else ""
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns, library_name=LIBRARY_NAME)
    except GatedRepoError as error:
        raise CheckpointNotFoundError(f"Hub model {repo_id!r} is gated: accept its terms on the Hub, then log in "
                                      "(`hf auth login` or HF_TOKEN)") from error
    except RepositoryNotFoundError as error:
        raise CheckpointNotFoundError(f"{repo_id!r} is neither a local directory nor a Hub model (or it is private: "
                                      "log in with `hf auth login` or set HF_TOKEN)") from error
    except RevisionNotFoundError as error:
        raise CheckpointNotFoundError(f"Hub model {repo_id!r} has no revision {shown_revision!r}") from error
    except LocalEntryNotFoundError as error:  # offline, or the Hub unreachable, and nothing usable in the cache
        how = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        if type(error).__name__ == "IncompleteSnapshotError" or weights:
            raise CheckpointNotFoundError(f"the cached copy of Hub model {repo_id!r}{at} in {constants.HF_HUB_CACHE} "
                                          f"lacks files clover-jax reads ({how})") from error
        raise CheckpointNotFoundError(f"{repo_id!r}{at} is neither a local directory nor in the Hub cache "
                                      f"{constants.HF_HUB_CACHE} ({how})") from error
    except OSError as error:  # HTTP errors, a full disk
        raise CheckpointNotFoundError(f"cannot fetch Hub model {repo_id!r}{at}: {_one_line(error)}") from error
    logger.info("%s%s: %s", repo_id, at, folder)
    return Path(folder)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
