"""Where a decoding entry point puts the weights: a weight format and a device mesh, from flags
(`--quantize`, `--mesh DATA,EXPERT,TENSOR`) or from `--target auto` (what `clover_jax.plan`
recommends for this process's devices, by arithmetic). Shared by `clover-jax serve`,
`clover-jax generate`, the in-process lm-eval model and `build_service`.

    check_placement(quantize="int4", mesh="1,8,1", target=None)    # before anything loads
    placement = resolve_placement(config, quantize=None, mesh=None, target="auto",
                                  context_length=32768, batch=16)
    CloverModel.from_pretrained(path, **placement.load_options())

Decoding keeps the data axis at 1: the serving engine's lanes and `generate`'s single prompt are
not split over a batch axis (run one process per replica for data parallelism). `--target auto`
on devices the plan splits over a data axis folds it into the tensor axis (logged).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

from clover_jax.core.quantization import QuantSpec

logger = logging.getLogger(__name__)

AUTO = "auto"
AXES = ("data", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class Placement:
    """A weight format and a mesh: `quantize` (None: as stored), `mesh_shape` ({"data", "expert",
    "tensor"}, or None: the default device), `rules` (None: `ShardingRules()`), and where they
    came from, in words (`reason`)."""

    quantize: QuantSpec | None = None
    mesh_shape: dict | None = None
    rules: Any = None
    reason: str = "as given"

    def load_options(self) -> dict:
        """Keyword arguments of `CloverModel.from_pretrained` (the mesh made over this process's devices)."""
        from clover_jax.parallel.sharding import make_mesh

        mesh = None if self.mesh_shape is None else make_mesh(**self.mesh_shape)
        return {"quantize": self.quantize, "mesh": mesh, "rules": self.rules}

    def describe(self) -> str:
        weights = "as stored" if self.quantize is None else self.quantize.name
        mesh = "one device" if self.mesh_shape is None else \
            "mesh " + ",".join(str(self.mesh_shape[axis]) for axis in AXES) + " (data,expert,tensor)"
        return f"weights {weights}, {mesh}"


def parse_mesh(mesh: "str | Sequence[int] | dict") -> dict:
    """"DATA,EXPERT,TENSOR" (or three integers, or a dict of them) as {"data", "expert", "tensor"};
    ValueError saying what is wrong."""
    if isinstance(mesh, dict):
        sizes = [mesh.get(axis, 1) for axis in AXES]
    elif isinstance(mesh, str):
        parts = [part.strip() for part in mesh.split(",")]
        try:
            sizes = [int(part) for part in parts]
        except ValueError:
            sizes = []
        if len(parts) != 3 or len(sizes) != 3:
            raise ValueError(f"mesh must be three integers DATA,EXPERT,TENSOR such as 1,8,1, got {mesh!r}")
    else:
        sizes = list(mesh)
    if len(sizes) != 3 or any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in sizes):
        raise ValueError(f"mesh sizes DATA,EXPERT,TENSOR must be three integers >= 1, got {mesh!r}")
    return dict(zip(AXES, sizes, strict=True))


def check_placement(*, quantize: "str | QuantSpec | None", mesh: Any, target: str | None,
                    devices: int | None = None, adapter: Any = None) -> dict | None:
    """Every check that needs no weights (ValueError naming the flag): a known format, a mesh of
    three sizes whose product is the device count and whose data axis is 1, `target` "auto"
    alone. devices: the device count to check against (None: this process's). Returns the mesh
    shape, or None."""
    if quantize is not None and not isinstance(quantize, QuantSpec):
        try:
            QuantSpec.parse(quantize)
        except ValueError as error:
            raise ValueError(f"--quantize: {error}") from None
    if target is not None:
        if target != AUTO:
            raise ValueError(f"--target must be 'auto' (the format and mesh `clover-jax plan` recommends for this "
                             f"machine's devices), got {target!r}")
        given = [flag for flag, value in (("--mesh", mesh), ("--quantize", quantize)) if value is not None]
        if given:
            raise ValueError(f"--target auto chooses the weight format and mesh itself; drop {' and '.join(given)} "
                             "or --target")
    if mesh is None:
        return None
    if adapter is not None:
        raise ValueError("--adapter loads onto one device: merge the adapter into its base (a LoRA run's "
                         "merged checkpoint) to load it with --mesh")
    try:
        shape = parse_mesh(mesh)
    except ValueError as error:
        raise ValueError(f"--mesh: {error}") from None
    if shape["data"] != 1:
        raise ValueError(f"--mesh: DATA must be 1 for decoding (the batch is not split over devices; run one "
                         f"process per replica), got {mesh!r}; put the devices on EXPERT and TENSOR")
    count = _device_count() if devices is None else devices
    if math.prod(shape.values()) != count:
        raise ValueError(f"--mesh {','.join(map(str, shape.values()))} is {math.prod(shape.values())} devices, but "
                         f"this machine has {count}; DATA x EXPERT x TENSOR must equal the device count")
    return shape


def resolve_placement(config, *, quantize: "str | QuantSpec | None", mesh: Any, target: str | None,
                      context_length: int, batch: int) -> Placement:
    """The placement the arguments ask for (checked as `check_placement` does), `--target auto`
    resolved by `clover_jax.plan` for this process's devices at `context_length` positions and
    `batch` sequences (ValueError when nothing fits). config: a `CloverConfig`."""
    shape = check_placement(quantize=quantize, mesh=mesh, target=target)
    if target is None:
        spec = quantize if isinstance(quantize, QuantSpec) or quantize is None else QuantSpec.parse(quantize)
        return Placement(spec, shape, _rules(shape) if shape else None)
    from clover_jax.parallel.planner import estimate

    plan = estimate(config, None, context_length=context_length, batch=batch)
    chosen = plan.recommendation
    if chosen is None:
        raise ValueError(f"--target auto: {plan.reason}")
    shape = dict(chosen.mesh)
    reason = f"plan for {plan.target}: {plan.reason}"
    if shape["data"] > 1:  # decoding does not split the batch: the data axis's devices split dense heads
        shape = {"data": 1, "expert": shape["expert"], "tensor": shape["tensor"] * shape["data"]}
        reason += f"; the data axis folded into tensor ({shape['tensor']})"
    if math.prod(shape.values()) == 1:
        shape = None
    placement = Placement(chosen.quantize, shape, _rules(shape) if shape else None, reason)
    logger.info("--target auto: %s (%s)", placement.describe(), reason)
    return placement


def _rules(shape: dict):
    """The planner's sharding rules for an inference mesh (`planner.inference_rules`)."""
    from clover_jax.parallel.planner import inference_rules

    return inference_rules(shape)


def _device_count() -> int:
    import jax

    return jax.device_count()
