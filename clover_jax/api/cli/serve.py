"""`clover-jax serve`: load, warm up, serve until interrupted."""

from __future__ import annotations

import argparse
import sys

from clover_jax.api.cli.common import (
    BUNDLED_MODEL,
    UsageError,
    check_model_format,
    is_hub_snapshot,
    resolve_model_dir,
    resolve_placement,
)


def run_serve(args: argparse.Namespace) -> int:
    """`clover-jax serve`: load, warm up, serve until interrupted."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    check_model_format(args)
    if not args.body_timeout > 0:
        raise UsageError(f"--body-timeout must be > 0 seconds, got {args.body_timeout}")
    for flag, value in (("--max-running", args.max_running), ("--max-body-bytes", args.max_body_bytes),
                        ("--max-connections", args.max_connections)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not args.prefix_cache_gb >= 0:
        raise UsageError(f"--prefix-cache-gb must be >= 0, got {args.prefix_cache_gb}")
    if args.prefix_cache_grid < 1:
        raise UsageError(f"--prefix-cache-grid must be >= 1, got {args.prefix_cache_grid}")
    if args.kv_cache_gb is not None and not args.kv_cache_gb > 0:
        raise UsageError(f"--kv-cache-gb must be > 0, got {args.kv_cache_gb}")
    if args.precompile is not None and args.no_precompile:
        raise UsageError("--precompile and --no-precompile exclude each other")
    sizes = None
    if args.block_sizes is not None:
        try:
            sizes = tuple(int(size) for size in args.block_sizes.split(","))
        except ValueError:
            raise UsageError(f"--block-sizes must be integers separated by commas, got {args.block_sizes!r}") from None
        if not sizes or min(sizes) < 1:
            raise UsageError(f"--block-sizes must be integers >= 1, got {args.block_sizes!r}")
    modes = precompiled_modes(args.precompile)
    path = resolve_model_dir(args.model, args.revision)
    name = args.served_model_name or args.model or BUNDLED_MODEL.name
    from clover_jax.core.config import CloverConfig

    config = CloverConfig.from_pretrained(path)
    placement = resolve_placement(config, args, context_length=args.max_context or config.max_position_embeddings,
                                  batch=args.max_running)
    if args.target:
        print(f"clover-jax serve: --target {args.target}: {placement.reason}", file=sys.stderr)
    print(f"clover-jax serve: loading {name} ({placement.describe()}) ...", file=sys.stderr)
    from clover_jax.api.serving.server import build_service, precompile, serve, warm_up

    model = args.model if is_hub_snapshot(args.model) else path
    service = build_service(str(model), name=name, max_running=args.max_running, max_queue=args.max_queue,
                            max_context=args.max_context, block_sizes=sizes, dtype=args.dtype,
                            revision=args.revision if is_hub_snapshot(args.model) else None,
                            quantize=placement.quantize, adapter=args.adapter, mesh=placement.mesh_shape,
                            prefix_cache_bytes=int(args.prefix_cache_gb * 2**30),
                            prefix_cache_grid=args.prefix_cache_grid,
                            kv_cache_bytes=None if args.kv_cache_gb is None else int(args.kv_cache_gb * 2**30))
    if args.precompile is None and not args.no_precompile and on_accelerator():
        modes = precompiled_modes("all")
    if modes:
        done = precompile(service, modes=modes)
        print(f"clover-jax serve: precompiled {done.programs} programs in {done.seconds:.1f} s ({done.covers})",
              file=sys.stderr)
    elif not args.no_warmup:
        print(f"clover-jax serve: warmed up in {warm_up(service):.1f} s", file=sys.stderr)
    print(f"clover-jax serve: serving {name!r} at http://{args.host}:{args.port}/v1 (max {args.max_running} "
          f"running, {args.max_queue} queued){'; API key required' if args.api_key else ''}", file=sys.stderr)
    if args.log_requests:
        import logging

        log = logging.getLogger("clover_jax.api.serving.requests")
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
            log.addHandler(handler)
        log.setLevel(logging.INFO)
    serve(service, args.host, args.port, args.api_key, args.max_body_bytes, body_timeout=args.body_timeout,
          max_connections=args.max_connections, log_requests=args.log_requests)
    return 0


def on_accelerator() -> bool:
    """Whether JAX runs on a TPU or GPU here (where `serve` precompiles by default)."""
    import jax

    return jax.default_backend() != "cpu"


def precompiled_modes(value: str | None) -> tuple[str, ...]:
    """The modes `--precompile` names ("all": every mode; None: no precompile)."""
    from decoding.modes import MODES

    if value is None:
        return ()
    if value == "all":
        return MODES
    modes = tuple(mode.strip() for mode in value.split(","))
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise UsageError(f"--precompile takes modes among {', '.join(MODES)} separated by commas, got {value!r}")
    return tuple(dict.fromkeys(modes))
