"""Decoding: LowConfidence block diffusion (docs/design.md §4) and autoregressive mode, in jitted loops."""

from decoding import schedules
from decoding.generation import GenerateOutput, generate
from decoding.generation_config import GenerationConfig

__all__ = ["GenerateOutput", "GenerationConfig", "generate", "schedules"]
