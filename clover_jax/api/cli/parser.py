"""The `clover-jax` argument parser: its commands and their flags."""

from __future__ import annotations

import argparse
import os

from clover_jax.api.cli import train
from clover_jax.api.cli.common import BUNDLED_MODEL, DTYPES, short
from clover_jax.api.cli.finetune_flags import add_finetune_flags
from clover_jax.api.cli.flags import add_generation_flags, float_arg, int_arg
from clover_jax.api.cli.generate import run_generate
from clover_jax.api.cli.info import run_info, run_plan
from clover_jax.api.cli.render import MASK_GLYPH, REJECTED_MARK
from clover_jax.api.cli.serve import run_serve
from decoding.modes import MODES
from decoding.serving_defaults import DEFAULT_GRID, DEFAULT_PREFIX_CACHE_BYTES


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit status 2) instead of the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_model_format_flags(command: argparse.ArgumentParser) -> None:
    """--quantize, --adapter, --mesh and --target: how and where the weights are held, for `generate` and `serve`."""
    command.add_argument("--quantize", default=None, metavar="FORMAT",
                         help="weight-only quantisation while loading: int8, int4, int4-g<group>, with +dense to "
                              "quantise the dense weights too (docs/quantization.md; default: none)")
    command.add_argument("--adapter", default=None, metavar="DIR",
                         help="a LoRA adapter directory written by a LoRA or QLoRA run of `clover-jax train`, "
                              "merged into --model (its base) while loading (docs/training.md)")
    command.add_argument("--mesh", default=None, metavar="DATA,EXPERT,TENSOR",
                         help="split the weights over this machine's devices: a mesh whose sizes multiply to the "
                              "device count, DATA 1 (e.g. 1,8,1: experts over 8 chips; docs/parallelism.md; "
                              "default: one device)")
    command.add_argument("--target", default=None, choices=("auto",),
                         help="auto: the weight format and mesh `clover-jax plan` recommends for this machine's "
                              "devices (by arithmetic; logged); not with --quantize or --mesh")


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
                          f"{short(BUNDLED_MODEL)})")
    gen.add_argument("--revision", metavar="REV", default=None,
                     help="branch, tag or commit of a Hub id (default: its main branch)")
    think = gen.add_mutually_exclusive_group()
    think.add_argument("--enable-thinking", dest="enable_thinking", action="store_true", default=True,
                       help="render the chat template with enable_thinking=True (default)")
    think.add_argument("--no-think", dest="enable_thinking", action="store_false",
                       help="render the chat template with enable_thinking=False")
    gen.add_argument("--system", metavar="TEXT", help="a system message before the prompt")
    gen.add_argument("--raw", action="store_true", help="encode the prompt as it is, without the chat template")
    gen.add_argument("--mode", choices=MODES, default="diffusion",
                     help="block diffusion (default); token by token through the causal backbone; or "
                          "self_speculative: a denoising pass drafts --block-size tokens, a causal pass verifies "
                          "them (greedy, the autoregressive output)")
    gen.add_argument("--seed", type=int_arg, default=0, help="PRNG seed for --do-sample (default 0)")
    gen.add_argument("--dtype", choices=DTYPES, default=None,
                     help="parameter and activation dtype (default: the checkpoint's)")
    add_model_format_flags(gen)
    gen.add_argument("--show-steps", action="store_true",
                     help=f"show each block being denoised step by step ({MASK_GLYPH} = still masked); with "
                          f"--mode self_speculative, each round's draft: accepted tokens, [the causal pass's own "
                          f"token], {REJECTED_MARK} then the rejected drafts")
    gen.add_argument("--step-delay", type=float_arg, default=None, metavar="SECONDS",
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
    info.add_argument("--context", type=int_arg, default=None, metavar="TOKENS",
                      help="prompt + response positions for the memory estimate (default: the model's context)")
    info.add_argument("--batch", type=int_arg, default=1, metavar="N", help="sequences for the memory estimate")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(run=run_info)

    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, /health, "
                    "/metrics) "
                    "with continuous batching of block diffusion; see docs/serving.md.")
    serve.add_argument("--model", metavar="DIR|ORG/NAME", default=None,
                       help=f"checkpoint directory or Hugging Face Hub id (default: the bundled tiny model, "
                            f"{short(BUNDLED_MODEL)})")
    serve.add_argument("--revision", metavar="REV", default=None, help="branch, tag or commit of a Hub id")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int_arg, default=8000, help="port (default 8000)")
    serve.add_argument("--max-running", type=int_arg, default=8, metavar="N",
                       help="requests decoding at once, batched in every step (default 8)")
    serve.add_argument("--max-queue", type=int_arg, default=64, metavar="N",
                       help="requests waiting beyond them; more are answered 503 (default 64)")
    serve.add_argument("--max-context", type=int_arg, default=None, metavar="TOKENS",
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
    add_model_format_flags(serve)
    serve.add_argument("--max-body-bytes", type=int_arg, default=8 << 20, metavar="BYTES",
                       help="largest request body accepted (default 8 MiB)")
    serve.add_argument("--body-timeout", type=float_arg, default=30.0, metavar="SECONDS",
                       help="a request body not complete this long after it starts is answered 408 (default 30)")
    serve.add_argument("--max-connections", type=int_arg, default=1024, metavar="N",
                       help="open connections served at once, the arriving one counted; 503 beyond (default 1024)")
    serve.add_argument("--prefix-cache-gb", type=float_arg, default=DEFAULT_PREFIX_CACHE_BYTES / 2**30, metavar="GIB",
                       help="device memory for the prefix cache, in GiB (default "
                            f"{DEFAULT_PREFIX_CACHE_BYTES / 2**30:g}; 0 turns it off)")
    serve.add_argument("--prefix-cache-grid", type=int_arg, default=DEFAULT_GRID, metavar="TOKENS",
                       help="the prefix cache keeps GDN states at multiples of this many tokens "
                            f"(default {DEFAULT_GRID})")
    serve.add_argument("--no-warmup", action="store_true",
                       help="skip the warm-up request that compiles the default decoding before serving")
    serve.add_argument("--kv-cache-gb", type=float_arg, default=None, metavar="GIB",
                       help="device memory for the K/V page pool, in GiB (default: every running request at the "
                            "full context, plus the prefix cache's budget up to as much again, at most 60%% of the "
                            "memory the device has free after the weights; docs/serving.md)")
    serve.add_argument("--precompile", nargs="?", const="all", default=None, metavar="MODE,MODE,...",
                       help="before the port opens, compile the served modes (all three, or those named: "
                            "diffusion, autoregressive, self_speculative) at every --block-sizes: one forward per "
                            "token padding and each mode's decisions, whatever the context, so that no request "
                            "waits on a compile (logs the program count and time). Default: all three on a TPU or "
                            "GPU; on a CPU a warm-up request instead (docs/serving.md)")
    serve.add_argument("--no-precompile", action="store_true",
                       help="do not precompile on an accelerator (the first requests then wait on compiles)")
    serve.add_argument("--log-requests", action="store_true",
                       help="log one line per request: method, path, status, seconds, request id")
    serve.set_defaults(run=run_serve)
    plan = commands.add_parser("plan", help="which weight format and mesh fit an accelerator (its compiler's word "
                                            "with --compile)",
                               description="Bytes per device of each weight format on the mesh a target allows, "
                                           "and the best that fits. With --compile, the decoding loops are compiled "
                                           "for the target by its own compiler, from this machine (docs/compiling.md).")
    plan.add_argument("model", nargs="?", metavar="DIR|ORG/NAME", default=None,
                      help="checkpoint directory or Hub id; only config.json is read (default: the bundled tiny model)")
    plan.add_argument("--target", required=True, metavar="NAME",
                      help="v5e-1, v5e-4, v5e-8, v6e-1, v6e-4, v6e-8, v5p-8, v5p-64, H100, H200 or H200xN (N GPUs)")
    plan.add_argument("--compile", action="store_true",
                      help="compile the diffusion, autoregressive and self-speculative loops for the target and let "
                           "the compiler decide what fits (minutes per format at full size)")
    plan.add_argument("--context-length", type=int_arg, default=32768, metavar="TOKENS",
                      help="prompt + response positions to budget for (default 32768)")
    plan.add_argument("--batch", type=int_arg, default=None, metavar="N",
                      help="sequences decoded together (default 1), or with --task train a step's (its --batch-size: "
                           "default 8)")
    plan.add_argument("--revision", metavar="REV", default=None, help="branch, tag or commit of a Hub id")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--task", choices=("decode", "train"), default="decode",
                      help="decode (the default) or train: one fine-tuning run of --batch sequences of --seq-len "
                           "tokens, described by the flags below as `clover-jax train` reads them; with --compile "
                           "its train step is compiled for the target (docs/training.md)")
    trained = plan.add_argument_group(
        "--task train", "the run's FinetuneConfig, as `clover-jax train` reads it; without --remat the planner "
                        "chooses the remat (with --offload-base from layer onwards)")
    add_finetune_flags(trained, skip=("batch_size", "generation_config"))
    plan.set_defaults(run=run_plan)
    train.add_parser(commands)
    return parser
