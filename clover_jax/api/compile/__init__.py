"""Compiling for an accelerator from this host, and reading the compiler's bytes (docs/compiling.md):
what one program needs per device and whether it fits (`program_memory`), the kernels and errors of
a deviceless compile (`deviceless`), the decoding loops (`decode_loops`), a fine-tuning run's
train step (`train_step`) and the serving engine's served set (`served_set`) as compile jobs, and the
subprocess that runs them (`worker`)."""
