"""What every command shares: its errors, the checkpoint it runs on, and number formatting."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from clover_jax.core.bundled import bundled_model_path

BUNDLED_MODEL = bundled_model_path()
INTERRUPTED_STATUS = 130  # 128 + SIGINT, what shells report for a command ended by Ctrl-C
DTYPES = ("float32", "bfloat16", "float16")


class CliError(Exception):
    """A problem to report as one line, exit status 1."""


class UsageError(CliError):
    """A flag whose value is refused (exit status 2, like argparse's own errors)."""


def resolve_model_dir(model: str | None, revision: str | None = None, quiet: bool = False) -> Path:
    """The checkpoint directory — a local one, or the Hub cache's snapshot of a Hub id with its
    configs and tokenizer (the weights come later) — checked before anything heavy is imported."""
    if model is None:
        if revision is not None:
            raise UsageError("--revision applies to a Hub id given with --model")
        if not (BUNDLED_MODEL / "config.json").is_file():
            raise CliError(f"the bundled model is not installed at {BUNDLED_MODEL}; pass --model DIR")
        return BUNDLED_MODEL
    from clover_jax.core.hub import resolve_checkpoint

    if quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    path = resolve_checkpoint(model, revision)
    if not (path / "config.json").is_file():
        raise CliError(f"{model!r} has no config.json: not a Hugging Face checkpoint directory")
    return path


def check_model_format(args) -> None:
    """--quantize, --adapter, --mesh and --target, checked before anything loads: a known format, an
    adapter directory, a mesh of this machine's devices, auto alone (`clover_jax.api.placement`)."""
    from clover_jax.api.placement import check_placement

    if args.adapter is not None and not Path(args.adapter).expanduser().is_dir():
        raise UsageError(f"--adapter {args.adapter!r} is not a directory (a LoRA run's adapter directory)")
    try:
        check_placement(quantize=args.quantize, mesh=args.mesh, target=args.target, adapter=args.adapter)
    except ValueError as error:
        raise UsageError(str(error)) from None


def resolve_placement(config, args, *, context_length: int, batch: int):
    """The weight format and mesh of --quantize / --mesh / --target (`clover_jax.api.placement`);
    --target auto's "nothing fits" as a CliError."""
    from clover_jax.api import placement

    try:
        return placement.resolve_placement(config, quantize=args.quantize, mesh=args.mesh, target=args.target,
                                           context_length=context_length, batch=batch)
    except ValueError as error:
        raise CliError(str(error)) from None


def is_hub_snapshot(model: str | None) -> bool:
    """Whether --model named a Hub id (a local directory of that name wins, as in `resolve_checkpoint`)."""
    return model is not None and not Path(model).expanduser().is_dir()


def config_record(generation) -> dict[str, Any]:
    """A GenerationConfig as JSON (a schedule function by its name)."""
    record = dataclasses.asdict(generation)
    record["eos_token_id"] = list(generation.eos_token_id)
    if callable(record.get("schedule")):
        record["schedule"] = getattr(generation.schedule, "__name__", "custom")
    return record


# ---------------------------------------------------------------------- formatting
def count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def human_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def short(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
