"""What a training pass's backward recomputes instead of keeping (docs/training.md, "Remat"), by name:
plain data, so the trainer's config reads the names without importing JAX.

"none": nothing; "full": each layer group from its input; "layer": each decoder layer from its
input; "dots": each layer group, keeping the matmul outputs that have no batch dimension;
"layer_offload": each decoder layer from its input, kept in host memory rather than on the chips.
"""

REMAT = ("none", "full", "layer", "dots", "layer_offload")
LAYER_INPUT = "layer_input"  # each decoder layer's input, named for the "layer_offload" remat policy
