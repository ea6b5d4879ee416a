"""The serving engine: continuous batching of block diffusion (and autoregressive and
self-speculative decoding) for many concurrent requests, one thread owning the model.
See `decoding.engine.engine` and docs/serving.md."""

from decoding.engine.engine import Engine, EngineClosed, Handle, QueueFull, Result
from decoding.engine.requests import EngineEvent, EngineRequest, RequestStats

__all__ = ["Engine", "EngineClosed", "EngineEvent", "EngineRequest", "Handle", "QueueFull", "RequestStats", "Result"]
