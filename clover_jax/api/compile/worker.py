"""The compile subprocess: compile jobs run in a fresh process that has the TPU and GPU compilers on
its path (`clover_jax.parallel.compilers`), so that the calling process never loads them.

`compile_in_subprocess(jobs)` starts `python -m clover_jax.api.compile.worker` with the jobs as JSON
on stdin (each with its kind: `decode_loops.CompileJob`, `train_step.TrainCompileJob` or
`served_set.ServedSetJob`) and reads
one `ProgramMemory` per compiled program back from the last line of stdout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from typing import Any, Sequence

from clover_jax.api.compile.decode_loops import CompileJob, compile_job
from clover_jax.api.compile.program_memory import ProgramMemory
from clover_jax.api.compile.served_set import ServedSetJob, compile_served_set
from clover_jax.api.compile.train_step import TrainCompileJob, compile_train_job

# Each kind of job: how it is read back from JSON, and how it is compiled.
JOBS = {CompileJob.KIND: (CompileJob.from_json, compile_job),
        TrainCompileJob.KIND: (TrainCompileJob.from_json, compile_train_job),
        ServedSetJob.KIND: (ServedSetJob.from_json, compile_served_set)}


def compile_in_subprocess(jobs: Sequence[Any], timeout: float | None = None) -> list[dict[str, ProgramMemory]]:
    """Each job compiled, in one fresh process that has the compilers on its path; per job, {program:
    its `ProgramMemory`}. Raises RuntimeError naming what is missing or what failed."""
    from clover_jax.parallel.compilers import compilers_dir, subprocess_environment

    payload = json.dumps([{"kind": job.KIND, "job": job.to_json()} for job in jobs])
    process = subprocess.run([sys.executable, "-m", "clover_jax.api.compile.worker"], input=payload,
                             capture_output=True, text=True, env=subprocess_environment(), timeout=timeout)
    if process.returncode != 0:
        tail = "\n".join(process.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"the compile subprocess failed (exit {process.returncode}); are the compilers "
                           f"installed (python -m clover_jax.parallel.compilers install → {compilers_dir()})?\n{tail}")
    raw = json.loads(process.stdout.strip().splitlines()[-1])
    return [{program: ProgramMemory(**memory) for program, memory in result.items()} for result in raw]


def main() -> int:
    """Subprocess entry: a JSON list of jobs on stdin, a JSON list of results on the last stdout line."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    results = []
    for entry in json.loads(sys.stdin.read()):
        read, compile_one = JOBS[entry["kind"]]
        compiled = compile_one(read(entry["job"]))
        results.append({program: dataclasses.asdict(memory) for program, memory in compiled.items()})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
