"""Research kit: sweeps of decoding schedules over a task, d3LLM's AUP, and the trade-off plot.

    from decoding import research
    records = research.sweep(model, {"low_confidence": {"threshold": [0.9, 0.7, 0.5]},
                                     "dream": {"alg": ["entropy"], "steps": [4, 8]}},
                             block_sizes=[8, 16], task=research.jsonl_task("problems.jsonl", tokenizer),
                             output="sweep.jsonl")
    research.aup_by_schedule(records)          # {"low_confidence (B=8)": ..., ...}
    research.plot_tradeoff(records)             # accuracy against tokens per forward (matplotlib)

A task is prompts (token ids) with a scorer: `jsonl_task` reads any JSONL of {"prompt": ...,
"answer": ...} lines; the bundled model's digit-sorting task, and tasks named by a string, are the
application's (`clover_jax.api.research_tasks`, whose `sweep` takes `task="sort"`). Every cell
of the grid (schedule × parameters × block size) decodes the whole task greedily (in batches of
`batch_size`) and gives one `SweepRecord`.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from tqdm.auto import tqdm

from decoding import schedules as schedule_registry
from decoding.generation import generate
from decoding.generation_config import GenerationConfig
from decoding.schedules.switch import ScheduleSwitch  # noqa: F401  (research.ScheduleSwitch, its first home)

logger = logging.getLogger(__name__)

Scorer = Callable[[str, str], "float | bool"]  # (response text, reference answer) -> 1.0 / True when right


# ---------------------------------------------------------------------- AUP
def aup(tpf: Sequence[float], accuracy: Sequence[float], y_max: float, alpha: float = 3.0,
        offset: float = 5.0) -> float:
    """Accuracy Under Parallelism (d3LLM): the area under accuracy (in %) against tokens per
    forward ρ, each accuracy weighted by W(y) = min(exp(-alpha (1 - y / y_max)), 1).

    Points are sorted by ρ (ties keep their order); y_1 is the accuracy at the smallest ρ, and
    points with y < y_1 - offset are dropped. AUP = ρ_1 y_1 + Σ_{i>=2} ½ (ρ_i - ρ_{i-1})
    (y_i W(y_i) + y_{i-1} W(y_{i-1})). `y_max` is usually the best accuracy of any method on the task.
    """
    rho, y = [list(map(float, values)) for values in (tpf, accuracy)]
    if not rho or len(rho) != len(y):
        raise ValueError(f"aup needs as many accuracies as tokens-per-forward values, at least one; "
                         f"got {len(rho)} and {len(y)}")
    if not all(math.isfinite(v) for v in rho + y) or min(rho) < 0:
        raise ValueError("aup needs finite accuracies and finite tokens per forward >= 0")
    if not (isinstance(y_max, (int, float)) and math.isfinite(y_max) and y_max > 0):
        raise ValueError(f"aup needs y_max > 0 (the best accuracy in %), got {y_max!r}")
    points = sorted(zip(rho, y, strict=True), key=lambda point: point[0])
    first = points[0][1]
    points = [point for point in points if point[1] >= first - offset]
    weighted = lambda accuracy_: accuracy_ * min(math.exp(-alpha * (1.0 - accuracy_ / y_max)), 1.0)
    area = points[0][0] * points[0][1]
    for (rho_before, y_before), (rho_here, y_here) in zip(points, points[1:], strict=False):
        area += 0.5 * (rho_here - rho_before) * (weighted(y_here) + weighted(y_before))
    return area


# ---------------------------------------------------------------------- tasks
@dataclasses.dataclass(frozen=True)
class Task:
    """Prompts as token ids, and `score(i, response_ids) -> 1.0 / 0.0` for prompt i's response
    (cut after the first EOS). `max_new_tokens` None: the generation config's."""

    name: str
    prompts: list[list[int]]
    score: Callable[[int, Sequence[int]], float]
    max_new_tokens: int | None = None


def final_answer_match(response: str, answer: str) -> bool:
    """The text after the last `</think>` (all of it when there is none), stripped, equals the answer."""
    return response.split("</think>")[-1].strip() == str(answer).strip()


def jsonl_task(path: str | os.PathLike, tokenizer, scorer: Scorer = final_answer_match, chat: bool = True,
               enable_thinking: bool = True, max_new_tokens: int | None = None, name: str | None = None) -> Task:
    """A task from a JSONL file of {"prompt": str, "answer": str} lines. `chat`: the prompt is the
    user message of the tokenizer's chat template (else encoded as is); `scorer(response text with
    special tokens removed, answer)` is truthy when the response is right."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task file {str(path)!r} does not exist")
    prompts, answers = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not JSON: {error}") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "answer" not in row:
            raise ValueError(f"{path}:{number} must be an object with a string 'prompt' and an 'answer'")
        text = row["prompt"]
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     enable_thinking=enable_thinking, tokenize=True, return_dict=False)
                       if chat else tokenizer.encode(text, add_special_tokens=False))
        answers.append(str(row["answer"]))
    if not prompts:
        raise ValueError(f"task file {str(path)!r} holds no prompts")

    def score(index: int, response: Sequence[int]) -> float:
        return float(bool(scorer(tokenizer.decode(response, skip_special_tokens=True), answers[index])))

    return Task(name or path.stem, prompts, score, max_new_tokens)


# ---------------------------------------------------------------------- sweep
@dataclasses.dataclass(frozen=True)
class SweepRecord:
    """One cell of a sweep. accuracy: % of prompts right; tokens_per_forward: response tokens
    over forward passes, pooled over the prompts; wall_time: seconds spent decoding the cell
    (compilation excluded when the sweep warms up); tokens_per_second: response tokens / wall_time."""

    task: str
    schedule: str
    params: dict
    block_size: int
    accuracy: float
    mean_nfe: float
    tokens_per_forward: float
    tokens_per_second: float
    wall_time: float
    prompts: int
    mean_response_tokens: float

    @property
    def label(self) -> str:
        return f"{self.schedule} (B={self.block_size})"


def sweep(model, schedules: Any = ("low_confidence",), block_sizes: Sequence[int] | None = None,
          task: "Task | None" = None, *, generation_config: GenerationConfig | None = None,
          batch_size: int | None = None,
          output: "str | os.PathLike | Sequence[str | os.PathLike] | None" = None,
          warmup: bool = True, share_compilation: bool = True, progress: bool = True,
          **overrides: Any) -> list[SweepRecord]:
    """Decode `task` under every schedule × parameter setting × block size; one record per cell.

    schedules: names (or schedule functions) with their defaults, or a mapping from a name (or
    function) to its grid: {parameter: [values]} (every combination) or a list of parameter dicts.
    block_sizes: None = the generation config's. task: a `Task` (by name or path:
    `clover_jax.api.research_tasks.sweep`).
    overrides: GenerationConfig fields for every cell. output: .jsonl / .csv path(s) the records
    are written to. warmup: decode the first batch once, untimed, before each compiled group
    (schedule × block size), so that wall times leave compilation out. share_compilation: the named
    schedules of the sweep run through one `ScheduleSwitch`, so the decoder compiles once per block
    size rather than once per schedule and block size (the decisions are the same).

    Every cell is checked (schedule names, parameter names, types and ranges, block sizes, the
    generation config) before anything is decoded.
    """
    base = _base_config(model, generation_config, overrides)
    task = _checked_task(task)
    max_new_tokens = task.max_new_tokens or base.max_new_tokens
    if max_new_tokens is None:
        raise ValueError(f"task {task.name!r} sets no max_new_tokens; pass max_new_tokens=...")
    sizes = [base.block_size] if block_sizes is None else list(block_sizes)
    if not sizes:
        raise ValueError("block_sizes is empty")
    paths = [] if output is None else [output] if isinstance(output, (str, os.PathLike)) else list(output)
    for path in paths:
        if Path(path).suffix not in (".jsonl", ".csv"):
            raise ValueError(f"output {str(path)!r} must end in .jsonl or .csv")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
    grids = _schedule_grids(schedules)
    named = [schedule for _, schedule, _ in grids if isinstance(schedule, str)]
    switch = ScheduleSwitch(named) if share_compilation and len(named) > 1 else None
    cells = []  # (label, schedule, given params, config) per cell, block size outermost within a schedule
    for label, schedule, grid in grids:
        for size in sizes:
            for params in grid:
                config = base.replace(block_size=size, max_new_tokens=max_new_tokens, schedule=schedule,
                                      schedule_params=params)
                schedule_registry.resolve_params(schedule, params, config)
                if switch is not None and isinstance(schedule, str):
                    config = config.replace(schedule=switch, schedule_params=switch.params(schedule, params, config))
                cells.append((label, schedule, params, config))

    records = []
    warmed = set()
    bar = tqdm(total=len(cells), desc=f"sweep {task.name}", unit="cell", disable=not progress)
    try:
        for label, schedule, params, config in cells:
            compiled = (config.schedule if callable(config.schedule) else label, config.block_size)
            if warmup and compiled not in warmed:
                first = next(iter(padded_batches(task.prompts, batch_size or len(task.prompts))))[0]
                generate(model, first, config)
                warmed.add(compiled)
            records.append(_run_cell(model, task, label, schedule, params, config, batch_size))
            logger.info("%s %s: accuracy %.1f%%, %.2f tokens/forward", records[-1].label, params,
                        records[-1].accuracy, records[-1].tokens_per_forward)
            bar.update(1)
    finally:
        bar.close()
    for path in paths:
        write_records(records, path)
    return records


def _base_config(model, generation_config: GenerationConfig | None, overrides: Mapping[str, Any]) -> GenerationConfig:
    if generation_config is None:
        path = getattr(model, "path", None)
        generation_config = GenerationConfig.from_pretrained(path) if path else GenerationConfig.for_model_type(
            model.config.model_type).with_token_ids(model.config)
    return generation_config.replace(**overrides)


def _checked_task(task: Any) -> Task:
    if not isinstance(task, Task):
        raise ValueError(f"task must be a decoding.research.Task, got {task!r} (by name or .jsonl path: "
                         "clover_jax.api.research_tasks.sweep)")
    return task


def _schedule_grids(schedules: Any) -> list[tuple[str, Any, list[dict]]]:
    """(label, schedule, [params per cell]) for each schedule of a sweep."""
    if isinstance(schedules, str) or callable(schedules):
        schedules = [schedules]
    items = list(schedules.items()) if isinstance(schedules, Mapping) else [(s, None) for s in schedules]
    if not items:
        raise ValueError("schedules is empty")
    grids = []
    for schedule, grid in items:
        if isinstance(schedule, str):
            schedule_registry.resolve(schedule)
            label = schedule
        elif callable(schedule):
            label = getattr(schedule, "__name__", repr(schedule))
        else:
            raise ValueError(f"a schedule must be a name in {sorted(schedule_registry.BY_NAME)} or a function, "
                             f"got {schedule!r}")
        if grid is None:
            cells = [{}]
        elif isinstance(grid, Mapping):
            names = list(grid)
            values = [list(v) if isinstance(v, (list, tuple, range)) else [v] for v in grid.values()]
            cells = [dict(zip(names, combination, strict=True)) for combination in itertools.product(*values)]
        elif isinstance(grid, Sequence) and all(isinstance(cell, Mapping) for cell in grid):
            cells = [dict(cell) for cell in grid]
        else:
            raise ValueError(f"the grid of {label!r} must be {{parameter: [values]}} or a list of parameter dicts, "
                             f"got {grid!r}")
        if not cells:
            raise ValueError(f"the grid of {label!r} has no cell")
        grids.append((label, schedule, cells))
    return grids


def padded_batches(prompts: Sequence[Sequence[int]], size: int) -> Iterator[tuple[list, int]]:
    """(batch, real count): `prompts` in batches of `size`, the last one padded by repeating its
    last prompt, so that every batch has one shape (one compiled decoder)."""
    for first in range(0, len(prompts), size):
        batch = [list(p) for p in prompts[first:first + size]]
        yield batch + [batch[-1]] * (size - len(batch)), len(batch)


def _run_cell(model, task: Task, label: str, schedule: Any, params: dict, config: GenerationConfig,
              batch_size: int | None) -> SweepRecord:
    correct, tokens, nfe = [], [], []
    started = time.perf_counter()
    for batch, real in padded_batches(task.prompts, batch_size or len(task.prompts)):
        out = generate(model, batch, config)
        for offset in range(real):
            correct.append(task.score(len(correct), out.sequences[offset]))
            tokens.append(len(out.sequences[offset]))
            nfe.append(out.nfe[offset])
    wall = time.perf_counter() - started
    return SweepRecord(task=task.name, schedule=label, params=_described_params(schedule, params, config),
                       block_size=config.block_size, accuracy=100.0 * sum(correct) / len(correct),
                       mean_nfe=sum(nfe) / len(nfe), tokens_per_forward=sum(tokens) / max(sum(nfe), 1),
                       tokens_per_second=sum(tokens) / wall, wall_time=wall, prompts=len(correct),
                       mean_response_tokens=sum(tokens) / len(tokens))


def _described_params(schedule: Any, params: dict, config: GenerationConfig) -> dict:
    """Every parameter of a named schedule with the value the cell used (defaults included)."""
    named = schedule_registry.BY_NAME.get(schedule) if isinstance(schedule, str) else None
    if named is None:
        return dict(params)
    described = {}
    for name, default in named.defaults.items():
        value = params.get(name, default)
        if value is schedule_registry.FROM_CONFIG:
            value = getattr(config, name)
        elif isinstance(value, schedule_registry.FromConfig):
            value = getattr(config, value.field)
        described[name] = value
    return described


# ---------------------------------------------------------------------- records
def write_records(records: Sequence[SweepRecord], path: str | os.PathLike) -> None:
    """Write records as JSONL (one object per line) or CSV (params as a JSON column), by suffix."""
    path = Path(path)
    rows = [dataclasses.asdict(record) for record in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    elif path.suffix == ".csv":
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=[f.name for f in dataclasses.fields(SweepRecord)])
            writer.writeheader()
            writer.writerows({**row, "params": json.dumps(row["params"], sort_keys=True)} for row in rows)
    else:
        raise ValueError(f"records are written as .jsonl or .csv, not {path.suffix!r} ({str(path)!r})")


def read_records(path: str | os.PathLike) -> list[SweepRecord]:
    """Records written by `write_records` (JSONL or CSV)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    elif path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        types = {f.name: f.type for f in dataclasses.fields(SweepRecord)}
        for row in rows:
            row["params"] = json.loads(row["params"])
            for name in row:
                if types[name] in ("int", "float"):
                    row[name] = (int if types[name] == "int" else float)(row[name])
    else:
        raise ValueError(f"records are read from .jsonl or .csv, not {path.suffix!r} ({str(path)!r})")
    return [SweepRecord(**row) for row in rows]


def group_by_schedule(records: Sequence[SweepRecord]) -> dict[str, list[SweepRecord]]:
    """Records per curve ("schedule (B=block size)"), each curve ordered by tokens per forward."""
    groups: dict[str, list[SweepRecord]] = {}
    for record in records:
        groups.setdefault(record.label, []).append(record)
    return {label: sorted(group, key=lambda r: r.tokens_per_forward) for label, group in groups.items()}


def aup_by_schedule(records: Sequence[SweepRecord], y_max: float | None = None, alpha: float = 3.0,
                    offset: float = 5.0) -> dict[str, float]:
    """The AUP of each curve ("schedule (B=block size)"); y_max: the best accuracy of all records."""
    if not records:
        raise ValueError("no records")
    y_max = max(r.accuracy for r in records) if y_max is None else y_max
    return {label: aup([r.tokens_per_forward for r in group], [r.accuracy for r in group], y_max, alpha, offset)
            for label, group in group_by_schedule(records).items()}


# ---------------------------------------------------------------------- plot
def plot_tradeoff(records: Sequence[SweepRecord], ax=None, annotate: bool = True, title: str | None = None):
    """Accuracy (%) against tokens per forward, one line per schedule and block size; each point
    annotated with the parameters that vary along its line. Needs matplotlib; returns the Axes."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("plot_tradeoff needs matplotlib, an optional dependency: pip install matplotlib") from error
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, group in group_by_schedule(records).items():
        ax.plot([r.tokens_per_forward for r in group], [r.accuracy for r in group], marker="o", label=label)
        varying = [name for name in group[0].params if len({json.dumps(r.params.get(name)) for r in group}) > 1]
        if annotate and varying:
            for r in group:
                text = ", ".join(f"{r.params[name]:g}" if isinstance(r.params[name], (int, float))
                                 else str(r.params[name]) for name in varying)
                ax.annotate(text, (r.tokens_per_forward, r.accuracy), fontsize=7, textcoords="offset points",
                            xytext=(3, 3))
    ax.set_xlabel("tokens per forward pass")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax
