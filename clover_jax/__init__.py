"""clover-jax: a JAX/Flax implementation of Clover-35B-A3B-Preview and its Qwen3.5-MoE backbone."""

from clover_jax.clover_model import CloverModel
from clover_jax.config import CloverConfig, ConfigError
from clover_jax.kernels import choose_kernels
from clover_jax.planner import plan
from clover_jax.quantization import QuantSpec
from clover_jax.sharding import MeshPlan, ShardingRules, make_mesh

__all__ = ["CloverModel", "CloverConfig", "ConfigError", "MeshPlan", "QuantSpec", "ShardingRules", "choose_kernels",
           "make_mesh", "plan"]
