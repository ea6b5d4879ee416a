"""What the compiler says one program needs per device, and the one rule for whether it fits."""

from __future__ import annotations

import dataclasses

from clover_jax.parallel.planner import HEADROOM


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """What the compiler says one program needs per device (bytes), or why it refused it."""

    argument_bytes: int = 0
    temp_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    error: str | None = None
    compile_seconds: float = 0.0
    kernel_calls: int = 0  # Pallas kernels (Mosaic on TPU, Triton on GPU) in the compiled program
    host_bytes: int = 0  # host memory the program's arguments and temporaries take per device (offloading)

    @property
    def total_bytes(self) -> int:
        """Peak bytes one device holds for the program: arguments, temporaries and the outputs
        that do not reuse an argument's buffer."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    def fits(self, device_bytes: int) -> bool:
        """Compiled, and within `HEADROOM` of a device of `device_bytes` (the rest is the runtime's)."""
        return self.error is None and self.total_bytes <= HEADROOM * device_bytes
