"""`clover-jax`: generate text with a checkpoint, or describe one, from the command line.

    clover-jax generate "sort 3 1 4 1 5"                     # the bundled tiny model (it sorts digits)
    clover-jax generate --show-steps --schedule fixed_k "sort 9 2 7 4"
    clover-jax generate --mode self_speculative --show-steps "sort 9 2 7 4"   # drafts and accepted runs
    clover-jax generate --model org/name --revision main "What is diffusion?"   # a Hub id
    clover-jax generate --model DIR --dtype bfloat16 --json "What is diffusion?"
    clover-jax info DIR
    clover-jax serve --model DIR --port 8000                 # an OpenAI-compatible server (docs/serving.md)

`--model` is a checkpoint directory or a Hugging Face Hub id (`clover_jax.core.hub`: only the files
clover-jax reads are downloaded, into the Hub cache; `HF_HUB_OFFLINE=1` works from the cache).
Every field of `decoding.GenerationConfig` is a flag of `generate` (`--block-size`,
`--threshold`, `--presence-penalty`, ...; booleans as `--do-sample` / `--no-do-sample`), built
from the dataclass so that none is forgotten; a flag left out keeps the checkpoint's
`generation_config.json` value. Errors are one line on stderr with a non-zero exit
status (2 for bad flags or input, 1 for everything else), never a traceback. Heavy imports (jax,
the model) happen after the arguments, the model's config and tokenizer and the prompt have been
checked. Ctrl-C at any moment — importing, downloading, loading, compiling, decoding, streaming —
ends the command at once with one line and exit status 130 (`ExitOnInterrupt`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from clover_jax.api import train_command

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "bundled" / "tiny-clover"  # clover_jax.bundled_model_path()
INTERRUPTED_STATUS = 130  # 128 + SIGINT, what shells report for a command ended by Ctrl-C
FALLBACK_MAX_NEW_TOKENS = 256  # when neither the flags nor generation_config.json set max_new_tokens
MASK_GLYPH = "░"
REJECTED_MARK = "¦"  # --show-steps, self-speculative: the drafts after it were rejected
DTYPES = ("float32", "bfloat16", "float16")

# One line of help per GenerationConfig field; a field missing here still gets a flag.
GENERATION_HELP = {
    "max_new_tokens": f"hard limit on response tokens (default: generation_config.json, else "
                      f"{FALLBACK_MAX_NEW_TOKENS})",
    "block_size": "tokens per diffusion block B",
    "threshold": "LowConfidence: fill every masked position whose confidence exceeds this",
    "do_sample": "sample instead of greedy decoding (with --seed, --temperature, --top-k, --top-p)",
    "temperature": "sampling temperature",
    "top_k": "sampling: keep the k most likely tokens (0: off)",
    "top_p": "sampling: nucleus probability mass",
    "presence_penalty": "subtracted from the logit of every token already in the response",
    "frequency_penalty": "subtracted per occurrence of a token in the response",
    "repetition_penalty": "divides positive / multiplies negative logits of repeated tokens (1.0: off)",
    "dllm_length_penalty": "full-strength bias towards EOS once the length ramp is complete",
    "dllm_length_penalty_start": "response length where the EOS bias starts",
    "dllm_length_penalty_window": "tokens over which the EOS bias ramps up",
    "dllm_think_end_bias": "full-strength bias towards </think> while thinking",
    "dllm_think_end_start": "response length where the </think> bias starts",
    "dllm_think_end_window": "tokens over which the </think> bias ramps up",
    "eos_token_id": "end-of-response token ids",
    "mask_token_id": "the mask token id (default: the checkpoint's)",
    "think_start_token_id": "id of <think> (default: from the tokenizer)",
    "think_end_token_id": "id of </think> (default: from the tokenizer)",
    "block_alignment": "'absolute' (blocks at multiples of B) or 'prompt' (blocks start after the prompt)",
    "schedule": "which positions are decided per denoising step",
    "max_steps_per_block": "denoising steps after which a block's remaining masks are filled (default: B)",
    "tokens_per_step": "fixed_k schedule: positions filled per step",
    "margin_threshold": "margin schedule: top-1 minus top-2 probability needed to fill",
    "entropy_bound": "entropy_bounded schedule: nats filled per step",
    "coreset": "block expert selection while denoising (default: the model config's)",
    "coreset_top_p": "coreset: fraction of the aggregated routing mass kept (default: the model config's)",
}


class CliError(Exception):
    """A problem to report as one line, exit status 1."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit status 2) instead of the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---------------------------------------------------------------------- flags from GenerationConfig
def _generation_fields():
    from decoding.generation_config import GenerationConfig

    return dataclasses.fields(GenerationConfig)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"threshold\": 0.8}}', got {text!r} "
                                         f"({error.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_generation_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `GenerationConfig` field, its kind read from the field's annotation."""
    from decoding.schedules import BY_NAME as SCHEDULES

    group = parser.add_argument_group("decoding controls (GenerationConfig fields; default: the checkpoint's "
                                      "generation_config.json)")
    for field in _generation_fields():
        kind = str(field.type)
        options: dict[str, Any] = dict(dest=f"gen_{field.name}", default=None,
                                       help=GENERATION_HELP.get(field.name, f"GenerationConfig.{field.name}"))
        names = [flag_name(field.name)]
        if field.name == "max_new_tokens":
            names.append("-n")
        if kind.startswith("bool"):
            options["action"] = argparse.BooleanOptionalAction
        elif kind.startswith("tuple[int"):
            options.update(type=_int, nargs="+", metavar="ID")
        elif field.name == "schedule":
            options.update(choices=sorted(SCHEDULES))
        elif field.name == "schedule_params":
            options.update(type=_json_object, metavar="JSON")
        elif kind.startswith("int"):
            options.update(type=_int, metavar="N")
        elif kind.startswith("float"):
            options.update(type=_float, metavar="X")
        else:
            options.update(type=str, metavar=field.name.upper())
        group.add_argument(*names, **options)


def generation_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The GenerationConfig fields given on the command line, each checked on its own so that an
    invalid value is reported with its flag."""
    from decoding.generation_config import GenerationConfig

    overrides = {}
    base = GenerationConfig.for_model_type("clover_moe")
    for field in _generation_fields():
        value = getattr(args, f"gen_{field.name}")
        if value is None:
            continue
        if str(field.type).startswith("tuple"):
            value = tuple(value)
        try:
            base.replace(**{field.name: value})
        except ValueError as error:
            raise UsageError(f"argument {flag_name(field.name)}: {error}") from None
        overrides[field.name] = value
    return overrides


class UsageError(CliError):
    """A flag whose value is refused (exit status 2, like argparse's own errors)."""


def _explain(message: str) -> str:
    """Name the flag when a GenerationConfig error message starts with a field name."""
    for field in _generation_fields():
        if message.startswith(field.name + " ") or message.startswith(field.name + "="):
            return f"{flag_name(field.name)}: {message}"
    return message


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="clover-jax", description="Clover block-diffusion language model (JAX) from the "
                                                    "command line.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the loader and decoder do")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    gen = commands.add_parser("generate", help="generate a response to a prompt",
                              description="Generate a response with block diffusion, "
                                          "autoregressively, or self-speculatively. The prompt goes "
                                          "through the checkpoint's chat template unless --raw.")
    gen.add_argument("prompt", nargs="?", help="the user message ('-' or absent: read standard input)")
    gen.add_argument("--model", metavar="DIR|ORG/NAME", default=None,
                     help=f"checkpoint directory or Hugging Face Hub id (default: the bundled tiny model, "
                          f"{_short(BUNDLED_MODEL)})")
    gen.add_argument("--revision", metavar="REV", default=None,
                     help="branch, tag or commit of a Hub id (default: its main branch)")
    think = gen.add_mutually_exclusive_group()
    think.add_argument("--enable-thinking", dest="enable_thinking", action="store_true", default=True,
                       help="render the chat template with enable_thinking=True (default)")
    think.add_argument("--no-think", dest="enable_thinking", action="store_false",
                       help="render the chat template with enable_thinking=False")
    gen.add_argument("--system", metavar="TEXT", help="a system message before the prompt")
    gen.add_argument("--raw", action="store_true", help="encode the prompt as it is, without the chat template")
    gen.add_argument("--mode", choices=("diffusion", "autoregressive", "self_speculative"), default="diffusion",
                     help="block diffusion (default); token by token through the causal backbone; or "
                          "self_speculative: a denoising pass drafts --block-size tokens, a causal pass verifies "
                          "them (greedy, the autoregressive output)")
    gen.add_argument("--seed", type=_int, default=0, help="PRNG seed for --do-sample (default 0)")
    gen.add_argument("--dtype", choices=DTYPES, default=None,
                     help="parameter and activation dtype (default: the checkpoint's)")
    gen.add_argument("--show-steps", action="store_true",
                     help=f"show each block being denoised step by step ({MASK_GLYPH} = still masked); with "
                          f"--mode self_speculative, each round's draft: accepted tokens, [the causal pass's own "
                          f"token], {REJECTED_MARK} then the rejected drafts")
    gen.add_argument("--step-delay", type=_float, default=None, metavar="SECONDS",
                     help="pause between --show-steps frames (default: 0.1 on a terminal, 0 otherwise)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object: the response and its metrics (nfe, tokens per forward, steps "
                          "per block, seconds, tokens/s)")
    gen.add_argument("--warmup", action="store_true",
                     help="run once before the timed run, so seconds and tokens/s exclude compilation")
    gen.add_argument("--show-special", action="store_true", help="keep special tokens (e.g. <|im_end|>) in the text")
    gen.add_argument("--quiet", action="store_true", help="no loading progress or summary on stderr")
    add_generation_flags(gen)
    gen.set_defaults(run=run_generate)

    info = commands.add_parser("info", help="describe a checkpoint: config, parameters, memory",
                               description="Config summary, parameter count (total and active per token) and the "
                                           "memory a request needs per dtype.")
    info.add_argument("model", nargs="?", metavar="DIR|ORG/NAME", default=None,
                      help="checkpoint directory or Hub id (default: the bundled tiny model)")
    info.add_argument("--revision", metavar="REV", default=None, help="branch, tag or commit of a Hub id")
    info.add_argument("--context", type=_int, default=None, metavar="TOKENS",
                      help="prompt + response positions for the memory estimate (default: the model's context)")
    info.add_argument("--batch", type=_int, default=1, metavar="N", help="sequences for the memory estimate")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(run=run_info)

    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, /health) "
                    "with continuous batching of block diffusion; see docs/serving.md.")
    serve.add_argument("--model", metavar="DIR|ORG/NAME", default=None,
                       help=f"checkpoint directory or Hugging Face Hub id (default: the bundled tiny model, "
                            f"{_short(BUNDLED_MODEL)})")
    serve.add_argument("--revision", metavar="REV", default=None, help="branch, tag or commit of a Hub id")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=_int, default=8000, help="port (default 8000)")
    serve.add_argument("--max-running", type=_int, default=8, metavar="N",
                       help="requests decoding at once, batched in every step (default 8)")
    serve.add_argument("--max-queue", type=_int, default=64, metavar="N",
                       help="requests waiting beyond them; more are answered 503 (default 64)")
    serve.add_argument("--max-context", type=_int, default=None, metavar="TOKENS",
                       help="prompt + response positions per request (default: the model's context)")
    serve.add_argument("--block-sizes", default=None, metavar="B,B,...",
                       help="block sizes a request may ask for (default: the checkpoint's, 16, 32, 64)")
    serve.add_argument("--api-key", default=os.environ.get("CLOVER_JAX_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every request (default: $CLOVER_JAX_API_KEY, "
                            "else none)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model's name in the API (default: --model as given)")
    serve.add_argument("--dtype", choices=DTYPES, default=None,
                       help="parameter and activation dtype (default: the checkpoint's)")
    serve.add_argument("--max-body-bytes", type=_int, default=8 << 20, metavar="BYTES",
                       help="largest request body accepted (default 8 MiB)")
    serve.add_argument("--no-warmup", action="store_true",
                       help="skip the warm-up request that compiles the default decoding before serving")
    serve.set_defaults(run=run_serve)
    plan = commands.add_parser("plan", help="which weight format and mesh fit an accelerator (its compiler's word "
                                            "with --compile)",
                               description="Bytes per device of each weight format on the mesh a target allows, "
                                           "and the best that fits. With --compile, the decoding loops are compiled "
                                           "for the target by its own compiler, from this machine (docs/compiling.md).")
    plan.add_argument("model", nargs="?", metavar="DIR|ORG/NAME", default=None,
                      help="checkpoint directory or Hub id; only config.json is read (default: the bundled tiny model)")
    plan.add_argument("--target", required=True, metavar="NAME",
                      help="v5e-1, v5e-4, v5e-8, v6e-1, v6e-4, v6e-8, v5p-8, H100, H200 or H200xN (N GPUs)")
    plan.add_argument("--compile", action="store_true",
                      help="compile the diffusion, autoregressive and self-speculative loops for the target and let "
                           "the compiler decide what fits (minutes per format at full size)")
    plan.add_argument("--context-length", type=_int, default=32768, metavar="TOKENS",
                      help="prompt + response positions to budget for (default 32768)")
    plan.add_argument("--batch", type=_int, default=1, metavar="N", help="sequences decoded together (default 1)")
    plan.add_argument("--revision", metavar="REV", default=None, help="branch, tag or commit of a Hub id")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(run=run_plan)
    train_command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    prog = "clover-jax"
    with ExitOnInterrupt(prog):
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
            return args.run(args) or 0
        except UsageError as error:
            sub = f"{prog} {args.command}"
            print(f"{sub}: error: {_one_line(error)} (see {sub} --help)", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # only where ExitOnInterrupt could not take over SIGINT
            print(f"{prog}: interrupted", file=sys.stderr)
            return INTERRUPTED_STATUS
        except BrokenPipeError:  # `clover-jax ... | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        except (CliError, ValueError, OSError) as error:  # ConfigError, TokenizerError, generate's checks
            print(f"{prog}: error: {_explain(_one_line(error))}", file=sys.stderr)
            return 1
        except Exception as error:  # a bug: still one line, the traceback with --verbose
            if logging.getLogger().isEnabledFor(logging.INFO):
                raise
            print(f"{prog}: internal error: {type(error).__name__}: {_one_line(error)} (run with -v for the "
                  "traceback)", file=sys.stderr)
            return 1


class ExitOnInterrupt:
    """Ctrl-C ends the process at once: one line on stderr, exit status 130, nothing else runs.

    A KeyboardInterrupt raised in the middle of jax — inside an XLA host callback, while a
    computation or a compilation is in flight, halfway through importing an extension — crashed
    the process (a segfault in most trials) or came back as an unrelated ImportError. So SIGINT
    never becomes an exception here: the C-level handler writes to a wakeup pipe that a daemon
    thread watches, and that thread (or the Python-level handler, whichever runs first) prints
    one line and calls `os._exit`. The thread is what makes it immediate while the main thread is
    held inside a long XLA call. Where SIGINT is ignored (`nohup`, a background job) or this is not
    the main thread, nothing is changed. Leaving the block restores the previous handlers.
    """

    def __init__(self, prog: str):
        self.message = f"{prog}: interrupted\n".encode()
        self.installed = False
        self.leaving = threading.Lock()

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
            return self
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: self.leave())
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self.watch, name="clover-jax-interrupt", daemon=True).start()
        self.installed = True
        return self

    def watch(self) -> None:
        while True:
            try:
                received = os.read(self.read_fd, 64)
            except OSError:
                return
            if not received:  # __exit__ closed the pipe
                return
            if signal.SIGINT in received:
                self.leave()

    def leave(self) -> None:
        if not self.leaving.acquire(blocking=False):
            return  # the other path is already leaving
        try:
            os.write(2, self.message)
        finally:
            os._exit(INTERRUPTED_STATUS)

    def __exit__(self, *exc_info) -> None:
        if not self.installed:
            return
        signal.set_wakeup_fd(self.previous_fd)
        signal.signal(signal.SIGINT, self.previous_handler)
        os.close(self.write_fd)  # the watcher reads end-of-file and returns
        os.close(self.read_fd)


# ---------------------------------------------------------------------- generate
def run_generate(args: argparse.Namespace) -> int:
    overrides = generation_overrides(args)
    if args.show_steps and args.mode == "autoregressive":
        raise UsageError("--show-steps shows diffusion blocks or self-speculative rounds; it does not apply to "
                         "--mode autoregressive")
    prompt = read_prompt(args.prompt)
    system = _utf8(args.system, "--system") if args.system is not None else None
    status = _Status(quiet=args.quiet or args.json)
    path = resolve_model_dir(args.model, args.revision, quiet=status.quiet)

    from clover_jax.api.tokenization import Tokenizer
    from clover_jax.core.config import CloverConfig

    config = CloverConfig.from_pretrained(path)
    tokenizer = Tokenizer.from_pretrained(path)
    prompt_ids = encode_prompt(tokenizer, prompt, args, system)
    generation = resolve_generation_config(path, config, overrides)
    context = config.max_position_embeddings
    if len(prompt_ids) + generation.max_new_tokens > context:  # generate() checks again, with the block rounding
        raise CliError(f"the prompt has {len(prompt_ids)} tokens and --max-new-tokens is "
                       f"{generation.max_new_tokens}: {len(prompt_ids) + generation.max_new_tokens} positions "
                       f"exceed the model's context of {context} tokens (max_position_embeddings)")

    status.say(f"loading {args.model or _short(path)} ...")
    started = time.perf_counter()
    import jax

    from clover_jax import CloverModel
    from decoding import generate

    if _is_hub_snapshot(args.model):  # the weights of the commit the config and tokenizer came from
        model = CloverModel.from_pretrained(args.model, revision=path.name, dtype=args.dtype,
                                            progress=not status.quiet)
    else:
        model = CloverModel.from_pretrained(path, dtype=args.dtype, progress=not status.quiet)
    load_seconds = time.perf_counter() - started
    status.say(f"loaded in {load_seconds:.1f} s on {jax.devices()[0].platform}; decoding "
               f"({args.mode}, {len(prompt_ids)} prompt tokens; the first call compiles) ...")

    key = jax.random.key(args.seed)
    options = dict(generation_config=generation, key=key, mode=args.mode)
    if args.mode != "autoregressive":
        options["return_trajectory"] = args.show_steps or args.json
    stream = None
    if not args.json and not args.show_steps and args.mode == "diffusion":
        stream = _StreamPrinter(tokenizer, generation, skip_special=not args.show_special)
        options["on_block"] = stream
    if args.warmup:  # the same call (same compiled loop), its output discarded
        if stream is not None:
            stream.muted = True
        generate(model, [prompt_ids], **options)
        if stream is not None:
            stream.reset()
    output = generate(model, [prompt_ids], **options)

    response = output.sequences[0]
    text = tokenizer.decode(response, skip_special_tokens=not args.show_special)
    frames_out = sys.stderr if args.json else sys.stdout
    if args.show_steps:
        delay = args.step_delay if args.step_delay is not None else (0.1 if frames_out.isatty() else 0.0)
        if args.mode == "self_speculative":
            render_rounds(tokenizer, response, output.trajectory[0], generation, frames_out, delay)
        else:
            render_steps(tokenizer, prompt_ids, response, output.trajectory[0]["step"], output.steps_per_block[0],
                         generation, frames_out, delay)
    metrics = _metrics(output, load_seconds, args.warmup)
    eos = set(generation.eos_token_id)  # resolved with the checkpoint's (`resolve_generation_config`)
    finished = "eos" if response and response[-1] in eos else "max_new_tokens"
    if args.json:
        record = {"model": str(path), "mode": args.mode, "prompt": prompt, "prompt_tokens": len(prompt_ids),
                  "response": text, "response_tokens": len(response), "token_ids": response, "finished_by": finished,
                  "metrics": metrics, "generation_config": _config_record(generation)}
        if output.trajectory:
            record["trajectory"] = output.trajectory[0]
        print(json.dumps(record, ensure_ascii=False))
        return 0
    if stream is not None:
        stream.finish(text)
    else:
        if args.show_steps:
            print(file=frames_out)
        print(text)
    status.say(_summary(metrics, len(response), finished, args.mode))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """`clover-jax serve`: load, warm up, serve until interrupted."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    for flag, value in (("--max-running", args.max_running), ("--max-body-bytes", args.max_body_bytes)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {args.max_queue}")
    sizes = None
    if args.block_sizes is not None:
        try:
            sizes = tuple(int(size) for size in args.block_sizes.split(","))
        except ValueError:
            raise UsageError(f"--block-sizes must be integers separated by commas, got {args.block_sizes!r}") from None
        if not sizes or min(sizes) < 1:
            raise UsageError(f"--block-sizes must be integers >= 1, got {args.block_sizes!r}")
    path = resolve_model_dir(args.model, args.revision)
    name = args.served_model_name or args.model or BUNDLED_MODEL.name
    print(f"clover-jax serve: loading {name} ...", file=sys.stderr)
    from clover_jax.api.serving.server import build_service, serve, warm_up

    model = args.model if _is_hub_snapshot(args.model) else path
    service = build_service(str(model), name=name, max_running=args.max_running, max_queue=args.max_queue,
                            max_context=args.max_context, block_sizes=sizes, dtype=args.dtype,
                            revision=args.revision if _is_hub_snapshot(args.model) else None)
    if not args.no_warmup:
        print(f"clover-jax serve: warmed up in {warm_up(service):.1f} s", file=sys.stderr)
    print(f"clover-jax serve: serving {name!r} at http://{args.host}:{args.port}/v1 (max {args.max_running} "
          f"running, {args.max_queue} queued){'; API key required' if args.api_key else ''}", file=sys.stderr)
    serve(service, args.host, args.port, args.api_key, args.max_body_bytes)
    return 0


def encode_prompt(tokenizer, prompt: str, args: argparse.Namespace, system: str | None = None) -> list[int]:
    """The prompt's ids: through the chat template (with --system, enable_thinking), or raw."""
    if args.raw:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=args.enable_thinking,
                                         return_dict=False)


def resolve_generation_config(path: Path, config, overrides: dict[str, Any]):
    """The checkpoint's generation_config.json with the flags applied, checked before the weights load.

    Its special token ids are the checkpoint's where neither the flags nor generation_config.json
    set them (`decoding.generation_config.resolve_token_ids`)."""
    from decoding.generation_config import GenerationConfig

    generation = GenerationConfig.from_pretrained(path)
    if generation.max_new_tokens is None and "max_new_tokens" not in overrides:
        overrides = {**overrides, "max_new_tokens": FALLBACK_MAX_NEW_TOKENS}
    try:
        generation = generation.replace(**overrides)
    except ValueError as error:  # a combination of flags and stored values (e.g. temperature 0 with sampling)
        raise UsageError(_explain(str(error))) from None
    for name in ("eos_token_id", "mask_token_id", "think_start_token_id", "think_end_token_id"):
        value = getattr(generation, name)  # generate() checks these too, after the weights load
        bad = [i for i in (value if isinstance(value, tuple) else [value])
               if i is not None and not 0 <= i < config.vocab_size]
        if bad:
            raise UsageError(f"{flag_name(name)}: {name} {bad} is outside the vocabulary [0, {config.vocab_size})")
    if generation.top_k > config.vocab_size:
        raise UsageError(f"{flag_name('top_k')}: top_k {generation.top_k} is larger than the vocabulary "
                         f"({config.vocab_size}); 0 turns top-k off")
    return generation


def resolve_model_dir(model: str | None, revision: str | None = None, quiet: bool = False) -> Path:
    """The checkpoint directory — a local one, or the Hub cache's snapshot of a Hub id with its
    configs and tokenizer (the weights come later) — checked before anything heavy is imported."""
    if model is None:
        if revision is not None:
            raise UsageError("--revision applies to a Hub id given with --model")
        if not (BUNDLED_MODEL / "config.json").is_file():
            raise CliError(f"the bundled model is not installed at {BUNDLED_MODEL}; pass --model DIR")
        return BUNDLED_MODEL
    from clover_jax.core.hub import resolve_checkpoint

    if quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    path = resolve_checkpoint(model, revision)
    if not (path / "config.json").is_file():
        raise CliError(f"{model!r} has no config.json: not a Hugging Face checkpoint directory")
    return path


def _is_hub_snapshot(model: str | None) -> bool:
    """Whether --model named a Hub id (a local directory of that name wins, as in `resolve_checkpoint`)."""
    return model is not None and not Path(model).expanduser().is_dir()


def read_prompt(prompt: str | None) -> str:
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("no prompt: pass it as an argument, or '-' to read standard input")
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UsageError(f"standard input is not valid UTF-8 (byte 0x{data[error.start]:02x} at offset "
                             f"{error.start})") from None
    else:
        prompt = _utf8(prompt, "the prompt")
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return prompt


def _utf8(text: str, what: str) -> str:
    """`text` from the command line, refused if it held bytes that are not UTF-8 (Python keeps
    them as lone surrogates, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise UsageError(f"{what} is not valid UTF-8 (at character {error.start})") from None
    return text


class _Status:
    """Progress and summaries on stderr (never on stdout, which holds the response)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def say(self, message: str) -> None:
        if not self.quiet:
            print(message, file=sys.stderr, flush=True)


class _StreamPrinter:
    """`generate(on_block=...)` listener: prints the response as its blocks are decided."""

    def __init__(self, tokenizer, generation, skip_special: bool):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.eos, self.limit = set(generation.eos_token_id), generation.max_new_tokens
        self.reset()

    def reset(self) -> None:
        self.ids, self.printed, self.done, self.muted = [], "", False, False

    def __call__(self, index: int, tokens: list, block_number: int) -> None:
        if self.done or self.muted:
            return
        for token in tokens:
            if len(self.ids) >= self.limit:
                self.done = True
                break
            self.ids.append(int(token))
            if token in self.eos:
                self.done = True
                break
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special).rstrip("\ufffd")
        if text.startswith(self.printed) and len(text) > len(self.printed):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text

    def finish(self, text: str) -> None:
        rest = text[len(self.printed):] if text.startswith(self.printed) else "\n" + text
        sys.stdout.write(rest + "\n")
        sys.stdout.flush()


def render_steps(tokenizer, prompt_ids: Sequence[int], response: Sequence[int], fill_steps: Sequence[int],
                 steps_per_block: Sequence[int], generation, out, delay: float = 0.0) -> None:
    """Replay the denoising of each block from the trajectory recorded inside the jitted loop.

    One line per denoising step: the block's positions, decided tokens as text and masked ones
    as MASK_GLYPH; tokens filled at that step are highlighted on a terminal. The prompt tail that
    opens the first block (absolute alignment) is shown as decided from the start. Schedules
    that remask show each position's last fill. The block the response ends in stops at the step
    that decided its last shown position (the positions past the end are not shown).
    """
    size, prompt_length = generation.block_size, len(prompt_ids)
    tail = prompt_length % size if generation.block_alignment == "absolute" else 0
    glyph = MASK_GLYPH if _encodable(MASK_GLYPH, out) else "_"
    color = out.isatty() and os.environ.get("NO_COLOR") is None
    new, dim, reset = ("\x1b[1;32m", "\x1b[2m", "\x1b[0m") if color else ("", "", "")
    blocks = []  # per block: [(token, step or 0 for prompt)]
    first = [(token, 0) for token in prompt_ids[prompt_length - tail:]] if tail else []
    for t, (token, step) in enumerate(zip(response, fill_steps, strict=True)):
        k = (tail + t) // size
        while len(blocks) <= k:
            blocks.append(first if not blocks else [])
        blocks[k].append((token, int(step)))
    width = len(str(len(blocks) - 1))
    for k, cells in enumerate(blocks):
        last_fill = max((s for _, s in cells), default=0)
        steps = max(steps_per_block[k] if k < len(steps_per_block) else 0, last_fill)
        # the response may end inside the last block: stop once its shown positions are decided
        frames = last_fill if k == len(blocks) - 1 else steps
        for step in range(1, frames + 1):
            parts = []
            for token, filled in cells:
                piece = _visible(tokenizer.decode([token]))
                if filled == 0:
                    parts.append(f"{dim}{piece}{reset}")
                elif filled < step:
                    parts.append(piece)
                elif filled == step:
                    parts.append(f"{new}{piece}{reset}")
                else:
                    parts.append(glyph)
            decided = sum(1 for _, filled in cells if filled <= step)
            print(f"block {k:>{width}} step {step:>2}/{steps:<2} │{''.join(parts)}│ {decided}/{len(cells)}",
                  file=out, flush=True)
            if delay:
                time.sleep(delay)


def render_rounds(tokenizer, response: Sequence[int], trajectory: dict, generation, out, delay: float = 0.0) -> None:
    """Replay self-speculative decoding round by round from the record kept inside the jitted loop.

    One line per round: the drafts accepted (green on a terminal), the causal pass's own token in
    brackets (where the draft first differed, or after a fully accepted draft), then
    REJECTED_MARK and the drafts rejected (dim). A round cut by EOS or max_new_tokens shows what it
    emitted and nothing rejected.
    """
    color = out.isatty() and os.environ.get("NO_COLOR") is None
    green, own, dim, reset = ("\x1b[1;32m", "\x1b[1;33m", "\x1b[2m", "\x1b[0m") if color else ("", "", "", "")
    text = lambda ids: "".join(_visible(tokenizer.decode([token])) for token in ids)
    rounds = list(zip(trajectory["drafts"], trajectory["accepted"], trajectory["emitted"], strict=True))
    width, position = len(str(len(rounds))), 0
    for number, (drafts, accepted, emitted) in enumerate(rounds, 1):
        tokens = response[position:position + emitted]
        position += emitted
        line = f"{green}{text(tokens[:accepted])}{reset}"
        if emitted > accepted:
            line += f"{own}[{text(tokens[accepted:])}]{reset}"
            if accepted < len(drafts):
                line += f"{dim}{REJECTED_MARK}{text(drafts[accepted:])}{reset}"
        print(f"round {number:>{width}}/{len(rounds)} │{line}│ {accepted}/{generation.block_size} drafts accepted, "
              f"{emitted} emitted", file=out, flush=True)
        if delay:
            time.sleep(delay)


def _visible(piece: str) -> str:
    return piece.replace("\n", "⏎").replace("\r", "␍").replace("\t", "⇥") or "∅"


def _encodable(text: str, stream) -> bool:
    try:
        text.encode(getattr(stream, "encoding", None) or "utf-8")
        return True
    except (UnicodeEncodeError, LookupError):
        return False


def _metrics(output, load_seconds: float, warm: bool) -> dict[str, Any]:
    tokens = len(output.sequences[0])
    steps = output.steps_per_block[0]
    return {
        "nfe": output.nfe[0],
        "tokens_per_forward": round(output.tokens_per_forward[0], 4),
        "steps_per_block": steps,
        "mean_steps_per_block": round(sum(steps) / len(steps), 3) if steps else None,
        "seconds": round(output.wall_time, 4),
        "tokens_per_second": round(tokens / output.wall_time, 2) if output.wall_time > 0 else None,
        "includes_compile": not warm,
        "load_seconds": round(load_seconds, 3),
        "distinct_experts_per_block": [round(d, 2) for d in output.distinct_experts_per_block[0]],
    }


def _summary(metrics: dict, tokens: int, finished: str, mode: str) -> str:
    steps = metrics["steps_per_block"]
    shown = steps if len(steps) <= 12 else steps[:12] + ["..."]
    blocks = {"diffusion": f"steps per block {shown}, ", "self_speculative": f"{len(steps)} rounds, "}.get(mode, "")
    compile_note = ", compile included" if metrics["includes_compile"] else ""
    return (f"-- {tokens} tokens (stopped by {finished}), {metrics['nfe']} forwards, "
            f"{metrics['tokens_per_forward']:.2f} tokens/forward, {blocks}"
            f"{metrics['seconds']:.2f} s ({metrics['tokens_per_second']} tokens/s{compile_note})")


def _config_record(generation) -> dict[str, Any]:
    record = dataclasses.asdict(generation)
    record["eos_token_id"] = list(generation.eos_token_id)
    if callable(record.get("schedule")):
        record["schedule"] = getattr(generation.schedule, "__name__", "custom")
    return record


# ---------------------------------------------------------------------- info
def run_info(args: argparse.Namespace) -> int:
    path = resolve_model_dir(args.model, args.revision, quiet=args.json)
    if args.batch < 1:
        raise UsageError("argument --batch: must be >= 1")
    from clover_jax.core.config import CloverConfig

    config = CloverConfig.from_pretrained(path)
    context = args.context or config.max_position_embeddings
    if context < 1:
        raise UsageError("argument --context: must be >= 1")
    record = describe(path, config, args.batch, context)
    if args.json:
        print(json.dumps(record))
    else:
        print(format_info(record))
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from clover_jax.parallel.targets import target

    try:
        target(args.target)
    except ValueError as error:
        raise UsageError(f"argument --target: {error}") from None
    if args.batch < 1 or args.context_length < 1:
        raise UsageError("arguments --batch and --context-length must be >= 1")
    if args.model is None and args.revision is not None:
        raise UsageError("--revision applies to a Hub id given as MODEL")
    from clover_jax.api.plan import plan as make_plan

    result = make_plan(args.model or BUNDLED_MODEL, args.target, context_length=args.context_length,
                       batch=args.batch, compile=args.compile, revision=args.revision)
    print(json.dumps(plan_record(result)) if args.json else result)
    return 0


def plan_record(result) -> dict[str, Any]:
    """A plan as JSON: each option's format, mesh, bytes per device (estimated and, when compiled,
    each loop's compiler figures or error) and whether it fits."""
    def option_record(option) -> dict[str, Any]:
        record = {"weights": option.weights, "quantize": None if option.quantize is None else option.quantize.name,
                  "mesh": option.mesh, "weight_bytes": option.weight_bytes, "state_bytes": option.state_bytes,
                  "estimate_bytes": option.total_bytes, "device_bytes": option.device_bytes, "fits": option.fits}
        if option.compiled is not None:
            record["compiled"] = {mode: {**dataclasses.asdict(memory), "total_bytes": memory.total_bytes}
                                  for mode, memory in option.compiled.items()}
        return record

    chosen = None if result.recommendation is None else result.options.index(result.recommendation)
    return {"target": result.target, "options": [option_record(option) for option in result.options],
            "recommendation": chosen, "reason": result.reason}


def parameter_counts(config) -> dict[str, int]:
    """Total parameters, the routed experts' share, and those one token uses (top-k of the experts),
    from the parameter table (`clover_jax.core.params.parameter_counts`)."""
    from clover_jax.core.params import parameter_counts as table_counts

    return table_counts(config)


def describe(path: Path, config, batch: int, context: int) -> dict[str, Any]:
    from clover_jax.api.tokenization import has_chat_template
    from clover_jax.parallel.memory import estimate_memory

    files = sorted(path.glob("*.safetensors"))
    has_template = has_chat_template(path)
    memory = {}
    for dtype in ("float32", "bfloat16"):
        estimate = estimate_memory(config, batch, context, dtype)
        memory[dtype] = {**dataclasses.asdict(estimate), "total": estimate.total}
    try:
        from decoding.generation_config import GenerationConfig

        generation = _config_record(GenerationConfig.from_pretrained(path))
    except ValueError as error:
        generation = {"error": str(error)}
    return {
        "path": str(path),
        "model_type": config.model_type,
        "checkpoint_dtype": config.checkpoint_dtype,
        "layers": config.num_hidden_layers,
        "layer_pattern": list(config.group_pattern),
        "layer_groups": config.num_groups,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "context": config.max_position_embeddings,
        "attention": {"heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                      "head_dim": config.head_dim, "rotary_dim": config.rotary_dim, "rope_theta": config.rope_theta},
        "gdn": {"key_heads": config.linear_num_key_heads, "value_heads": config.linear_num_value_heads,
                "key_head_dim": config.linear_key_head_dim, "value_head_dim": config.linear_value_head_dim,
                "conv_kernel": config.linear_conv_kernel_dim},
        "moe": {"experts": config.num_experts, "top_k": config.num_experts_per_tok,
                "expert_intermediate": config.moe_intermediate_size,
                "shared_expert_intermediate": config.shared_expert_intermediate_size},
        "clover": {"mask_token_id": config.mask_token_id, "coreset": config.moe_block_coreset_enabled,
                   "coreset_top_p": config.moe_block_coreset_top_p},
        "parameters": parameter_counts(config),
        "files": {"safetensors": len(files), "bytes": sum(f.stat().st_size for f in files),
                  "tokenizer": (path / "tokenizer.json").is_file(), "chat_template": has_template},
        "generation_config": generation,
        "memory": {"batch": batch, "context": context, "by_dtype": memory},
    }


def format_info(record: dict[str, Any]) -> str:
    att, gdn, moe, clover = record["attention"], record["gdn"], record["moe"], record["clover"]
    params, files, mem = record["parameters"], record["files"], record["memory"]
    pattern = ", ".join(record["layer_pattern"])
    generation = record["generation_config"]
    shown = ("block_size", "threshold", "max_new_tokens", "schedule", "presence_penalty", "repetition_penalty",
             "dllm_length_penalty", "dllm_think_end_bias", "eos_token_id")
    lines = [
        f"model         {record['path']}",
        f"type          {record['model_type']} ({record['checkpoint_dtype'] or 'dtype not stated'})",
        f"layers        {record['layers']} = {record['layer_groups']} x ({pattern})",
        f"sizes         hidden {record['hidden_size']}, vocab {record['vocab_size']}, "
        f"context {record['context']} tokens",
        f"attention     {att['heads']} query heads, {att['kv_heads']} K/V heads, head_dim {att['head_dim']}, "
        f"{att['rotary_dim']} rotary dims, rope_theta {att['rope_theta']:g}",
        f"gated delta   {gdn['key_heads']} key heads x {gdn['key_head_dim']}, {gdn['value_heads']} value heads x "
        f"{gdn['value_head_dim']}, conv kernel {gdn['conv_kernel']}",
        f"experts       {moe['experts']} routed (top-{moe['top_k']}, intermediate {moe['expert_intermediate']}) "
        f"+ 1 shared (intermediate {moe['shared_expert_intermediate']})",
        f"clover        mask_token_id {clover['mask_token_id']}, block coreset "
        f"{'on' if clover['coreset'] else 'off'} (top_p {clover['coreset_top_p']})",
        f"parameters    {_count(params['total'])} total, {_count(params['active_per_token'])} active per token "
        f"(routed experts {_count(params['routed_experts'])}, embeddings + head {_count(params['embeddings'])})",
        f"files         {files['safetensors']} safetensors file(s), {_bytes(files['bytes'])}; tokenizer.json "
        f"{'yes' if files['tokenizer'] else 'no'}; chat template {'yes' if files['chat_template'] else 'no'}",
    ]
    if "error" in generation:
        lines.append(f"generation    {generation['error']}")
    else:
        lines.append("generation    " + ", ".join(f"{k} {generation[k]}" for k in shown if k in generation))
    lines.append(f"memory        batch {mem['batch']}, {mem['context']} positions (prompt + response):")
    lines.append(f"  {'dtype':<10}{'parameters':>12}{'K/V cache':>12}{'GDN state':>12}{'activations':>13}"
                 f"{'total':>12}")
    for dtype, estimate in mem["by_dtype"].items():
        lines.append(f"  {dtype:<10}{_bytes(estimate['parameters']):>12}{_bytes(estimate['kv_cache']):>12}"
                     f"{_bytes(estimate['gdn_state']):>12}{_bytes(estimate['activations']):>13}"
                     f"{_bytes(estimate['total']):>12}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- formatting
def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _short(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
