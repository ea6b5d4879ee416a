"""Starting the server: a model, its tokenizer and an engine behind the HTTP app, on uvicorn.

    clover-jax serve --model DIR_OR_HUB_ID --port 8000            # the command line (clover_jax.api.cli)
    service = build_service("path/to/checkpoint", max_running=16)  # from Python
    precompile(service)                                            # optional: no request waits on a compile
    with ServerThread(create_app(service), port=8000): ...         # in this process, in a thread
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import uvicorn

from clover_jax.api.serving.app import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, create_app
from clover_jax.api.serving.service import Service
from decoding.serving_defaults import DEFAULT_BLOCK_SIZES, DEFAULT_GRID, DEFAULT_PREFIX_CACHE_BYTES

logger = logging.getLogger(__name__)

# The bound on open connections: uvicorn's limit_concurrency, which counts the arriving connection
# (N - 1 are served at once) and answers 503 beyond it, so that a flood of idle or slow clients cannot
# exhaust the process's sockets. Far above the engine's slots: waiting requests queue in the engine.
DEFAULT_MAX_CONNECTIONS = 1024


def build_service(path: str, *, name: str | None = None, max_running: int = 8, max_queue: int = 64,
                  max_context: int | None = None, block_sizes: tuple[int, ...] | None = None, dtype=None,
                  revision: str | None = None, progress: bool = False, quantize: str | None = None,
                  adapter: str | None = None, mesh=None, target: str | None = None,
                  prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                  prefix_cache_grid: int = DEFAULT_GRID, kv_cache_bytes: int | None = None) -> Service:
    """Load the checkpoint (a directory or a Hub id) and start its engine.

    name: the model's name in the API (default: `path` as given); block_sizes: the block sizes a
    request may ask for (default: the checkpoint's, 16, 32 and 64); quantize: weight-only
    quantisation while loading ("int8", "int4", ...); adapter: a LoRA adapter directory for the
    checkpoint (merged while loading; its tokenizer and generation config are the model's);
    mesh: "DATA,EXPERT,TENSOR" (or three sizes) over this process's devices, DATA 1; target:
    "auto", the format and mesh `clover_jax.plan` recommends for these devices at `max_context`
    positions and `max_running` sequences (`clover_jax.api.placement`; not with quantize or mesh);
    prefix_cache_bytes: the engine's prefix cache budget (0: none), prefix_cache_grid: its grid in
    tokens (`decoding.engine.prefix_cache`); kv_cache_bytes: the K/V page pool (None: the engine's
    default, `decoding.engine.shapes.pool_pages`)."""
    from clover_jax.api.placement import resolve_placement
    from clover_jax.core.config import CloverConfig
    from clover_jax.core.hub import resolve_checkpoint
    from clover_jax.model.clover_model import CloverModel
    from clover_jax.text.tokenizer import Tokenizer

    config = CloverConfig.from_pretrained(resolve_checkpoint(path, revision, require=("config.json",)))
    placement = resolve_placement(config, quantize=quantize, mesh=mesh, target=target, batch=max_running,
                                  context_length=max_context or config.max_position_embeddings)
    logger.info("loading %s: %s", path, placement.describe())
    tokenizer = Tokenizer.from_pretrained(adapter) if adapter else Tokenizer.from_pretrained(path, revision=revision)
    model = CloverModel.from_pretrained(path, dtype=dtype, revision=revision, progress=progress, adapter=adapter,
                                        **placement.load_options())
    engine = start_engine(model, max_running=max_running, max_queue=max_queue, max_context=max_context,
                          block_sizes=block_sizes, prefix_cache_bytes=prefix_cache_bytes,
                          prefix_cache_grid=prefix_cache_grid, kv_cache_bytes=kv_cache_bytes)
    return Service(model, tokenizer, engine, name or str(path), engine.block_sizes)


def start_engine(model, *, max_running: int = 8, max_queue: int = 64, max_context: int | None = None,
                 block_sizes: tuple[int, ...] | None = None, prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                 prefix_cache_grid: int = DEFAULT_GRID, kv_cache_bytes: int | None = None):
    """The engine `clover-jax serve` runs over a loaded `CloverModel`, with the server's defaults
    (`build_service`'s arguments; block sizes: the checkpoint's, 16, 32 and 64)."""
    from decoding.engine import Engine
    from decoding.validation import model_defaults

    sizes = tuple(block_sizes) if block_sizes else (model_defaults(model).block_size, *DEFAULT_BLOCK_SIZES)
    return Engine(model, max_running=max_running, max_queue=max_queue, max_context=max_context,
                  prefix_cache_bytes=prefix_cache_bytes, prefix_cache_grid=prefix_cache_grid, block_sizes=sizes,
                  kv_cache_bytes=kv_cache_bytes)


def warm_up(service: Service) -> float:
    """One short request through the engine, so that the first client does not wait for the
    programs of the checkpoint's default decoding to compile; returns the seconds it took."""
    from decoding.engine import EngineRequest

    started = time.perf_counter()
    ids = service.tokenizer.encode("Hello", add_special_tokens=False) or [0]
    service.engine.run([EngineRequest(ids, overrides={"max_new_tokens": 1})])
    return time.perf_counter() - started


def precompile(service: Service, *, modes: Sequence[str] | None = None, sample: bool = True):
    """Compile, before the port opens, the programs of `modes` (default: every mode) at the served
    block sizes: one forward per token padding and each mode's decisions, whatever the context
    (`Engine.precompile`); returns its `Precompiled` (program count, seconds). Requests outside
    that set compile on demand, logged with their shape."""
    return service.engine.precompile(modes, block_sizes=service.block_sizes, sample=sample)


def serve(service: Service, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, *, body_timeout: float = DEFAULT_BODY_TIMEOUT,
          max_connections: int = DEFAULT_MAX_CONNECTIONS, log_requests: bool = False) -> None:
    """Serve until interrupted (SIGINT/SIGTERM), then stop the engine. The engine is closed as the
    signal arrives, so that every request in flight ends at once with its shutdown error (an error
    event in a stream, 503 otherwise) while its connection is still open."""
    app = create_app(service, api_key, max_body_bytes, body_timeout=body_timeout, log_requests=log_requests)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                            limit_concurrency=max_connections)
    try:
        _ClosingServer(config, service.engine).run()
    finally:
        service.engine.close()


class _ClosingServer(uvicorn.Server):
    """uvicorn's server that, told to exit, closes the engine first (on a thread: closing waits for
    the engine's current step, a compile included), so that every request it held gets its
    shutdown error while the connections are open; then uvicorn's own exit runs (it finishes the
    open connections within `timeout_graceful_shutdown`). A second signal is uvicorn's at once."""

    def __init__(self, config: uvicorn.Config, engine):
        super().__init__(config)
        self.engine = engine
        self.closing: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.closing is not None:
            super().handle_exit(sig, frame)
            return
        self.closing = threading.Thread(target=self._close_then_exit, args=(sig, frame), name="clover-jax-shutdown",
                                        daemon=True)
        self.closing.start()

    def _close_then_exit(self, sig, frame) -> None:
        self.engine.close()
        super().handle_exit(sig, frame)


class ServerThread:
    """The app served by uvicorn on a thread of this process (tests, notebooks, benchmarks):
    `with ServerThread(app, port=0) as server: server.url`. port 0 picks a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, max_connections: int = DEFAULT_MAX_CONNECTIONS):
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                                    limit_concurrency=max_connections))
        self.thread = threading.Thread(target=self.server.run, name="clover-jax-http", daemon=True)
        self.host = host

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
