"""Serving through HTTP: `clover-jax serve --precompile` under 16 clients of the real `openai` client,
against the same requests through `generate` one at a time and the forward's own batching ceiling.

Per model (the bundled tiny Clover with its task's prompts; the medium random model of
`forward_cost.py` with random prompts, as in `benchmarks/serving.py`), in one run:

  * the server in a subprocess on a free 127.0.0.1 port: `clover-jax serve --precompile
    --max-running 16 --block-sizes B --prefix-cache-gb 0` (B: the checkpoint's block size; its other
    settings the defaults, the model's whole context among them). The precompile compiles every
    mode's programs (41 or fewer: a forward per token padding, whatever the context). The prefix
    cache is off: every method runs the same requests more than once (a warm-up, then rounds),
    and the cache would answer the repeats' prompts from the earlier runs, a different
    computation from `generate`'s and the in-process engine's (`prefix_cache.py` measures the
    cache). `--no-precompile` serves after the command line's default warm-up request instead
    (the same code with the engine's on-demand log turned on), and the untimed warm-up run
    compiles what the rounds need (the programs compiled during the timed rounds are counted
    from the server's log either way). The port opens after the precompile, so `/health`
    answering means it finished; the program count and seconds are read from the server's log;
  * 16 client threads sharing one `openai.OpenAI` client in a closed loop: each sends its next
    `/v1/completions` request the moment its previous one is answered. The prompt is sent as a
    list of token ids (the completions endpoint takes them as they are), greedy (`temperature`
    0), `max_tokens` as `--new`, the server's default mode (block diffusion);
  * in this process: `generate` one request at a time on the same prompts with the same controls
    (the baseline), the serving engine in-process at concurrency 16 (`engine_traffic.closed_loop`, for
    comparison; `--no-engine` skips it), and `serving.batching_ceiling` (16 one-sequence passes
    over one 16-sequence pass).

Methods alternate over `--rounds` rounds after an untimed warm-up run of each (`common.alternate`);
tokens/s is the response tokens of all requests (`usage.completion_tokens` through HTTP) over the
run's wall time, medians over rounds. gain = HTTP tokens/s over one at a time; fraction of the
ceiling = gain / ceiling. Target (`make bench`): >= 0.80 on the medium model; the bundled model's
figure is reported.

Tokens: the completions response carries text, not ids. Each response's text is compared with
`generate`'s tokens for that request decoded by the same tokenizer (special tokens skipped, as the
server does). The bundled model ships its tokenizer. The medium random checkpoint has none, so one
is written beside it: a word-level vocabulary with one distinct word per id (`<0>` ... `<32767>`),
decoded joined by spaces, the end-of-text and mask ids special; its text therefore names every
token, and equal text is equal tokens. The fraction of requests whose text is equal is reported,
not enforced: on the medium model a float32 near-tie between two candidate tokens can fall either
way between a batch of 16 and a batch of 1 (about 1 request in 48 has differed).

The machine is shared: the server and this process run on the same cores (the server idles while
this process measures `generate`), and other jobs add noise; compare within a run.

Usage: `python benchmarks/serving_http.py [--rounds 2] [--requests 256] [--medium-requests 48] [--models bundled
medium] [--no-engine] [--no-precompile] [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import alternate, check, emit, machine, ratio, setup_environment, write_random_checkpoint  # noqa: E402

setup_environment()

import numpy as np  # noqa: E402

from benchmarks.engine_traffic import (  # noqa: E402
    BUNDLED_DIR,
    Tickets,
    bundled_requests,
    closed_loop,
    random_requests,
)
from benchmarks.serving import batching_ceiling  # noqa: E402

CONCURRENCY = 16
TARGET = 0.80  # of the forward's batching ceiling, through HTTP, medium model
PRECOMPILED = re.compile(r"precompiled (\d+) programs in ([0-9.]+) s")
ON_DEMAND = re.compile(r"compiled (\d+) program\(s\) on demand")


# ---------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_child(model_dir: str, name: str, port: int, max_queue: int, block_size: int, precompile: bool) -> None:
    """What `clover-jax serve` runs (`clover_jax.api.cli.serve`) with the settings of the command
    in `Server`; serves until SIGTERM. Without `precompile` (`--no-precompile`; with it `Server`
    runs the command line itself), the default warm-up request, and every program compiled after
    it is logged as if nothing was precompiled (a `Precompiled` of 0 programs turns the engine's
    on-demand log on)."""
    import logging

    from clover_jax.api.serving.server import build_service, serve, warm_up
    from decoding.engine.precompile import Precompiled

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")  # programs compiled on demand
    service = build_service(model_dir, name=name, max_running=CONCURRENCY, max_queue=max_queue,
                            block_sizes=(block_size,), prefix_cache_bytes=0)
    if precompile:
        done = service.engine.precompile(block_sizes=service.block_sizes)
    else:
        done = service.engine.precompiled = Precompiled(0, warm_up(service), "nothing: one warm-up request")
    print(f"clover-jax serve: precompiled {done.programs} programs in {done.seconds:.1f} s ({done.covers})",
          file=sys.stderr, flush=True)
    serve(service, "127.0.0.1", port)


class Server:
    """The server (`serve_child`) in a subprocess; `with Server(...) as server:`
    returns once `/health` answers (after the precompile), and stops it (SIGTERM) on exit."""

    def __init__(self, model_dir: str, name: str, block_size: int, max_queue: int, precompile: bool = True,
                 timeout: float = 3600.0):
        self.port, self.name, self.timeout = free_port(), name, timeout
        if precompile:  # the command line itself
            self.command = [sys.executable, "-m", "clover_jax.api.cli", "serve", "--model", model_dir,
                            "--served-model-name", name, "--port", str(self.port), "--max-running", str(CONCURRENCY),
                            "--max-queue", str(max_queue), "--block-sizes", str(block_size),
                            "--prefix-cache-gb", "0", "--precompile"]
        else:
            self.command = [sys.executable, os.path.abspath(__file__), "--serve", model_dir, "--name", name,
                            "--port", str(self.port), "--max-queue", str(max_queue), "--block-size", str(block_size),
                            "--no-precompile"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="clover-bench-serve-", suffix=".log", delete=False)
        self.process: subprocess.Popen | None = None
        self.ready_seconds = None

    def __enter__(self) -> "Server":
        import httpx

        started = time.perf_counter()
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"))
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}) before it was ready:\n"
                                   + self.log_text()[-3000:])
            if time.perf_counter() - started > self.timeout:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the server was not ready after {self.timeout:.0f} s:\n" + self.log_text()[-3000:])
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.ready_seconds = time.perf_counter() - started
        return self

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as handle:
            return handle.read()

    def precompiled(self) -> dict:
        """What the server's log says of its precompile (programs, seconds, the set)."""
        text = self.log_text()
        found = PRECOMPILED.search(text)
        line = next((line for line in text.splitlines() if "precompiled" in line), "")
        return {"programs": int(found[1]) if found else None, "seconds": float(found[2]) if found else None,
                "log_line": line.strip(), "server_ready_s": self.ready_seconds}

    def compiled_on_demand(self) -> int:
        """Programs the server's engine compiled for requests, outside the precompiled set (its log)."""
        return sum(int(found[1]) for found in ON_DEMAND.finditer(self.log_text()))

    def on_demand_lines(self) -> list[str]:
        return [line.strip() for line in self.log_text().splitlines() if ON_DEMAND.search(line)]

    def __exit__(self, *exc_info) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


# ---------------------------------------------------------------------- clients
def http_closed_loop(client, name: str, prompts: list[list[int]], max_tokens: int,
                     concurrency: int = CONCURRENCY) -> dict:
    """`concurrency` threads, each sending its next completion the moment its last one is answered;
    per request its text, completion tokens and (sent, answered) times."""
    count = len(prompts)
    texts, tokens, times = [None] * count, [0] * count, np.zeros((count, 2))
    tickets, errors = Tickets(count), []

    def worker() -> None:
        while not errors:
            index = tickets.take()
            if index is None:
                return
            times[index, 0] = time.perf_counter()
            try:
                reply = client.completions.create(model=name, prompt=prompts[index], max_tokens=max_tokens,
                                                  temperature=0)
            except Exception as error:  # noqa: BLE001  (re-raised below, on the caller's thread)
                errors.append(error)
                return
            times[index, 1] = time.perf_counter()
            texts[index], tokens[index] = reply.choices[0].text, reply.usage.completion_tokens

    threads = [threading.Thread(target=worker, name=f"client-{i}") for i in range(min(concurrency, count))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"wall": time.perf_counter() - started, "texts": texts, "tokens": tokens, "times": times}


def one_at_a_time(model, requests) -> dict:
    """`generate` on each request alone, in turn: its tokens."""
    from decoding import generate

    started, tokens = time.perf_counter(), []
    for request in requests:
        tokens.append(generate(model, [list(request.prompt)], **request.overrides).sequences[0])
    return {"wall": time.perf_counter() - started, "tokens": tokens}


def tokens_per_s(run: dict, count) -> dict:
    total = count(run["last"])
    return {"tokens_per_s": total / run["median"], "tokens_per_s_samples": [total / s for s in run["samples"]],
            "response_tokens": total, "wall_s_samples": run["samples"]}


# ---------------------------------------------------------------------- one model
def measure(label: str, model_dir: str, name: str, requests, rounds: int, max_tokens: int, engine_too: bool,
            precompile: bool = True) -> dict:
    import openai

    from clover_jax import CloverModel
    from clover_jax.text.tokenizer import Tokenizer
    from decoding.engine import Engine

    for request in requests:  # greedy, as the HTTP requests ask (temperature 0)
        request.overrides["do_sample"] = False
    model = CloverModel.from_pretrained(model_dir, progress=False)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompts = [list(map(int, request.prompt)) for request in requests]
    engine = Engine(model, max_running=CONCURRENCY, max_queue=len(requests))
    print(f"serving_http: {label}: starting the server ...", file=sys.stderr)
    try:
        server = Server(model_dir, name, engine.defaults.block_size, max_queue=max(64, len(requests)),
                        precompile=precompile)
        with server:
            precompiled = server.precompiled()
            print(f"serving_http: {label}: server ready in {server.ready_seconds:.0f} s ({precompiled['log_line']})",
                  file=sys.stderr)
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=3600.0)
            methods = {"generate_one_at_a_time": lambda: one_at_a_time(model, requests),
                       "http_concurrency_16": lambda: http_closed_loop(client, name, prompts, max_tokens)}
            if engine_too:
                methods["engine_concurrency_16"] = lambda: closed_loop(engine, requests, CONCURRENCY)
            print(f"serving_http: {label}: warm-up run of each method, then {rounds} round(s) ...", file=sys.stderr)
            for method in methods.values():  # alternate's warm-up, here, to count the compiles after it apart
                method()
            precompiled["compiled_on_demand_in_warmup"] = server.compiled_on_demand()
            runs = alternate(methods, rounds, warmup=False)
            client.close()
            precompiled["compiled_on_demand"] = server.compiled_on_demand()
            precompiled["compiled_on_demand_in_rounds"] = (precompiled["compiled_on_demand"]
                                                           - precompiled["compiled_on_demand_in_warmup"])
            precompiled["compiled_on_demand_log"] = server.on_demand_lines()
        ceiling = batching_ceiling(engine, requests, slots=CONCURRENCY)  # the server stopped: its cores are free
    finally:
        engine.close()
    reference = runs["generate_one_at_a_time"]["last"]["tokens"]
    expected = [tokenizer.decode(list(map(int, t)), skip_special_tokens=True) for t in reference]
    http = runs["http_concurrency_16"]["last"]
    results = {"generate_one_at_a_time": tokens_per_s(runs["generate_one_at_a_time"],
                                                      lambda last: sum(len(t) for t in last["tokens"])),
               "http_concurrency_16": dict(tokens_per_s(runs["http_concurrency_16"], lambda last: sum(last["tokens"])),
                                           request_latency_ms=1e3 * float(np.median(http["times"][:, 1]
                                                                                    - http["times"][:, 0])))}
    results["http_concurrency_16"]["text_equal_to_generate_alone"] = (
        sum(a == b for a, b in zip(http["texts"], expected, strict=True)) / len(expected))
    results["http_concurrency_16"]["completion_tokens_equal_to_generate_alone"] = (
        sum(a == len(b) for a, b in zip(http["tokens"], reference, strict=True)) / len(reference))
    if engine_too:
        last = runs["engine_concurrency_16"]["last"]
        results["engine_concurrency_16"] = dict(
            tokens_per_s(runs["engine_concurrency_16"], lambda last: sum(len(t) for t in last["tokens"])),
            equal_to_generate_alone=sum(a == list(b) for a, b in zip(last["tokens"], reference, strict=True))
            / len(reference))
    base = results["generate_one_at_a_time"]["tokens_per_s"]
    gain = ratio(results["http_concurrency_16"]["tokens_per_s"], base)
    ratios = {"http_over_one_at_a_time": gain, "http_over_ceiling": ratio(gain, ceiling["ceiling"])}
    if engine_too:
        ratios["engine_over_one_at_a_time"] = ratio(results["engine_concurrency_16"]["tokens_per_s"], base)
        ratios["engine_over_ceiling"] = ratio(ratios["engine_over_one_at_a_time"], ceiling["ceiling"])
        ratios["http_over_engine"] = ratio(results["http_concurrency_16"]["tokens_per_s"],
                                           results["engine_concurrency_16"]["tokens_per_s"])
    print(f"serving_http: {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items() if v is not None)
          + f"; ceiling {ceiling['ceiling']:.2f}", file=sys.stderr)
    return {"requests": len(requests), "server": {"command": " ".join(server.command[1:]), **precompiled},
            "results": results, "ratios": ratios, "batching_ceiling": ceiling,
            "mismatched_requests": [i for i, (a, b) in enumerate(zip(http["texts"], expected, strict=True)) if a != b]}


def write_word_tokenizer(directory: str, vocab_size: int, special: list[int]) -> None:
    """A tokenizer for a random checkpoint: one word `<id>` per id, decoded joined by spaces, the
    `special` ids special (skipped when decoding). The brackets keep one word from matching inside
    another (special words are matched anywhere in a text)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(f"<{i}>", special=True) for i in special])
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as handle:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"<{special[0]}>"}, handle)


def measure_medium(args) -> dict:
    """The medium random model, written to a temporary directory with a word-level tokenizer."""
    from benchmarks.forward_cost import MEDIUM

    workdir = tempfile.mkdtemp(prefix="clover-bench-serving-http-")
    try:
        vocab = MEDIUM["vocab_size"]
        paths = write_random_checkpoint(workdir, MEDIUM, seed=0, clover=True, mask_token_id=vocab - 1)
        write_word_tokenizer(paths["clover"], vocab, special=[MEDIUM["eos_token_id"], vocab - 1])
        result = measure("medium random model", paths["clover"], "medium-random",
                         random_requests(args.medium_requests, vocab, args.prompt, args.new), args.rounds, args.new,
                         not args.no_engine, precompile=not args.no_precompile)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["config"] = {k: MEDIUM[k] for k in ("hidden_size", "num_hidden_layers", "num_experts",
                                               "num_experts_per_tok", "vocab_size")}
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=256,
                        help="requests per run on the bundled model (each ends within about two passes: 32 would "
                             "measure mostly the slots filling and draining)")
    parser.add_argument("--medium-requests", type=int, default=48,
                        help="requests per run on the medium model (three per client, as benchmarks/serving.py: one "
                             "wave of 16 leaves slots idle while the lane waits for its slowest request)")
    parser.add_argument("--prompt", type=int, default=64, help="longest random prompt (medium model)")
    parser.add_argument("--new", type=int, default=32, help="max_tokens of every request")
    parser.add_argument("--no-engine", action="store_true", help="skip the in-process engine's run")
    parser.add_argument("--no-precompile", action="store_true",
                        help="the server warms up instead of precompiling; the warm-up run compiles what the rounds "
                             "need, and the programs compiled during the rounds are counted")
    parser.add_argument("--models", nargs="+", choices=("bundled", "medium"), default=["bundled", "medium"],
                        help="which models to measure, in this order (--quick: bundled)")
    parser.add_argument("--quick", action="store_true", help="smoke test: the bundled model only, few requests")
    parser.add_argument("--serve", metavar="DIR", help=argparse.SUPPRESS)  # the server's subprocess
    for flag in ("--name", "--port", "--max-queue", "--block-size"):  # with --serve
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve_child(args.serve, args.name, int(args.port), int(args.max_queue), int(args.block_size),
                    not args.no_precompile)
        return
    if args.quick:
        args.rounds, args.requests, args.models = 1, 8, ["bundled"]

    models = {}
    for which in args.models:
        if which == "bundled":
            models["bundled"] = measure("bundled tiny Clover", BUNDLED_DIR, "tiny-clover",
                                        bundled_requests(args.requests, args.new), args.rounds, args.new,
                                        not args.no_engine, precompile=not args.no_precompile)
        else:
            models["medium"] = measure_medium(args)
    checks = []
    if "medium" in models:
        result = models["medium"]
        checks.append(check(
            "serving through HTTP (openai client): concurrency 16 over one at a time, as a fraction of the forward's "
            "batching ceiling (medium)", result["ratios"]["http_over_ceiling"], TARGET, True,
            note=f"server: {result['server']['log_line'].removeprefix('clover-jax serve: ')}, "
                 f"{result['server']['compiled_on_demand_in_rounds']} programs compiled in the timed rounds; "
                 f"gain {result['ratios']['http_over_one_at_a_time']:.2f}x of a ceiling of "
                 f"{result['batching_ceiling']['ceiling']:.2f}x measured in this run; response text equal to "
                 f"generate alone for {result['results']['http_concurrency_16']['text_equal_to_generate_alone']:.0%} "
                 "of the requests"))
    emit({"benchmark": "serving_http", "quick": args.quick, "rounds": args.rounds, "max_tokens": args.new,
          "concurrency": CONCURRENCY, "models": models, "checks": checks,
          "machine": machine()})


if __name__ == "__main__":
    main()
