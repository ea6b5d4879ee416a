"""The TPU and GPU compilers, kept beside the environment rather than in it.

Deviceless compilation needs the `libtpu` that `jax[tpu]` pins for the installed jax, the CUDA
plugin and PJRT of the installed jaxlib, and ptxas (`nvidia-cuda-nvcc-cu12`): clover-jax's `aot`
extra names them, pinned for the jax it is tested with. Installed into
site-packages they are on every process's path, and `import jax` then loads the CUDA plugin's
libraries (printing several "could not find cuda drivers" lines on a machine without a GPU) and
tries the TPU runtime at the first `jax.devices()` (about thirty lines of errors without a TPU).
So clover-jax installs them into a directory of their own, `<environment>/clover-jax-compilers`
(`CLOVER_JAX_COMPILERS` moves it), which only its compile subprocess puts on its path: importing
clover_jax, the CLI and CPU decoding never see them.

    python -m clover_jax.parallel.compilers install     # what `make test` runs
    python -m clover_jax.parallel.compilers status

`pip install "clover-jax[aot]"` installs the same packages into the environment itself; the compile
subprocess finds them there too, at the price of the noise above in every process.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

MARKER = ".clover-jax-compilers.json"


def compilers_dir() -> Path:
    """Where the compilers live: `CLOVER_JAX_COMPILERS`, else `<sys.prefix>/clover-jax-compilers`."""
    return Path(os.environ.get("CLOVER_JAX_COMPILERS") or Path(sys.prefix) / "clover-jax-compilers")


def requirements() -> list[str]:
    """The pip requirements of clover-jax's `aot` extra (pyproject.toml), checked against the
    installed jaxlib: the CUDA plugin must be built for it."""
    requires = importlib.metadata.requires("clover-jax") or []
    wanted = [requirement.split(";")[0].strip() for requirement in requires if 'extra == "aot"' in requirement]
    if not wanted:
        raise RuntimeError("clover-jax's metadata lists no 'aot' extra; reinstall it (pip install -e .)")
    jaxlib_version = importlib.metadata.version("jaxlib")
    for requirement in wanted:
        if requirement.startswith("jax-cuda12-plugin==") and requirement.split("==")[1] != jaxlib_version:
            raise RuntimeError(f"the aot extra pins {requirement}, but jaxlib {jaxlib_version} is installed: "
                               "install the jax version clover-jax pins, or update the extra")
    return wanted


def installed(directory: Path | None = None) -> dict | None:
    """The marker of an installation matching this jaxlib in `directory`, or None."""
    marker = (directory or compilers_dir()) / MARKER
    if not marker.is_file():
        return None
    recorded = json.loads(marker.read_text())
    return recorded if recorded.get("jaxlib") == importlib.metadata.version("jaxlib") else None


def install(directory: Path | None = None, quiet: bool = False) -> Path:
    """Install the compilers for this jaxlib into `directory` (a no-op when they are there)."""
    directory = Path(directory or compilers_dir())
    if installed(directory):
        return directory
    wanted = requirements()
    # --no-deps: jax and jaxlib are the environment's; the plugin's CUDA runtime libraries are not
    # needed to compile (ptxas is), and the TPU runtime needs nothing more.
    command = [sys.executable, "-m", "pip", "install", "--upgrade", "--target", str(directory), "--no-deps", *wanted]
    subprocess.run(command + (["--quiet"] if quiet else []), check=True)
    (directory / MARKER).write_text(json.dumps({"jaxlib": importlib.metadata.version("jaxlib"),
                                                "requirements": wanted}))
    return directory


def subprocess_environment(base: dict | None = None) -> dict:
    """The environment of a compile subprocess: the compilers on its path, JAX on the CPU for
    everything that is not a compile-only device, and no driver checks."""
    environment = dict(os.environ if base is None else base)
    directory = compilers_dir()
    if directory.is_dir():
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(directory)] + [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p])
    environment["JAX_PLATFORMS"] = "cpu"  # compile-only devices come from topologies, not from backends
    environment["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    # libtpu takes a machine-wide lock file (/tmp/libtpu_lockfile) for the TPU it expects to drive;
    # compile-only processes drive none, and two of them (parallel tests, a plan beside a benchmark)
    # would otherwise refuse each other.
    environment["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    environment.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return environment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clover_jax.parallel.compilers", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["install", "status"])
    parser.add_argument("--into", type=Path, default=None, help="directory (default: %(default)s → "
                        f"{compilers_dir()})")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    directory = args.into or compilers_dir()
    if args.command == "install":
        install(directory, quiet=args.quiet)
        print(f"compilers for jaxlib {importlib.metadata.version('jaxlib')} in {directory}")
        return 0
    marker = installed(directory)
    print(json.dumps({"directory": str(directory), "installed": marker is not None, **(marker or {})}))
    return 0 if marker else 1


if __name__ == "__main__":
    sys.exit(main())
