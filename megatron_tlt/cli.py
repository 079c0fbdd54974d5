"""The one entry point, `megatron-tlt` (also `python -m megatron_tlt`).

Each subcommand's implementation is imported only when that subcommand runs, so
`--help` stays fast and a piece that is missing from this build (or whose optional
dependency is absent) does not break the others. A subcommand whose module does not
exist yet says so on one line and exits 2.

Errors: a `TLTError` (bad config, path, checkpoint, parallel size...) is printed as
`error: <message>` on one stderr line, exit status 2, no traceback. Ctrl-C exits
130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import warnings
import os
import sys
from typing import Any, Callable

from megatron_tlt import __version__
from megatron_tlt.errors import ConfigError, TLTError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130

log = logging.getLogger(__name__)


class NotAvailable(Exception):
    """The module implementing a subcommand is not part of this build."""


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def setup_logging(level: str = "INFO") -> None:
    """Root logging to stderr, each line tagged with this process's rank."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s [rank{_rank()}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    # Megatron-Core and torch.distributed.checkpoint are chatty at INFO and warn on every
    # import about optional packages (TE, apex) and their own deprecations; users asked
    # for our progress, not theirs. --log-level DEBUG brings them back.
    if logging.getLogger().level > logging.DEBUG:
        for name in ("megatron", "torch.distributed.checkpoint"):
            logging.getLogger(name).setLevel(logging.WARNING)
        for module in (r"megatron\..*", r"torch\.distributed\.checkpoint\..*", r"transformers\..*"):
            warnings.filterwarnings("ignore", category=UserWarning, module=module)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
            warnings.filterwarnings("ignore", category=FutureWarning, module=module)


def _resolve(command: str, target: str) -> Callable[..., Any]:
    """The function named 'package.module:function', or NotAvailable if it is absent."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only the target module (or a package above it) missing means "not in this
        # build"; a missing dependency *inside* it is a real failure and propagates.
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise NotAvailable(command) from None
        raise
    fn = getattr(module, attr, None)
    if fn is None:
        raise NotAvailable(command)
    return fn


# ------------------------------------------------------------------ subcommands


def _run_with_config(args: argparse.Namespace, target: str) -> Any:
    from megatron_tlt.config import format_config, load_config, save_config

    cfg = load_config(args.config, args.overrides)  # bad input fails before anything else
    out_dir = cfg.train.out_dir
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"train.out_dir {out_dir!r} is a file, not a directory")
    fn = _resolve(args.command, target)
    if _rank() == 0:
        print(format_config(cfg), flush=True)
        path = os.path.join(cfg.train.out_dir, "config.yaml")
        save_config(cfg, path)
        log.info("resolved config saved to %s", path)
    return fn(cfg)


def _cmd_train(args: argparse.Namespace) -> Any:
    return _run_with_config(args, "megatron_tlt.rl.loop:main")


def _cmd_sft(args: argparse.Namespace) -> Any:
    return _run_with_config(args, "megatron_tlt.sft:main")


def _cmd_generate(args: argparse.Namespace) -> Any:
    return _resolve("generate", "megatron_tlt.rollout.cli:main")(args)


def _cmd_convert(args: argparse.Namespace) -> Any:
    command = f"convert {args.direction}"
    if args.direction == "hf-to-mcore":
        return _resolve(command, "megatron_tlt.convert:hf_to_mcore")(args.hf, args.out, args.tp, args.pp)
    return _resolve(command, "megatron_tlt.convert:mcore_to_hf")(args.mcore, args.out)


def _cmd_eval(args: argparse.Namespace) -> Any:
    return _resolve("eval", "megatron_tlt.evaluate:main")(args)


def _cmd_export_drafter(args: argparse.Namespace) -> Any:
    return _resolve("export-drafter", "megatron_tlt.spec.export:main")(args)


def _cmd_bench(args: argparse.Namespace) -> Any:
    if args.what is None:
        if not args.help:
            args.parser.error("name a benchmark: rollout, spec or e2e")  # exit 2
        args.parser.print_help()
        return 0
    if args.help:
        args.extra = ["--help", *args.extra]
    return _resolve("bench", "megatron_tlt.bench:main")(args)


def _cmd_demo(args: argparse.Namespace) -> Any:
    return _resolve("demo", "megatron_tlt.demo:main")(args)


# ---------------------------------------------------------------------- parser

# Subcommands that accept options the parser does not know; they reach the target
# function as `args.extra` (a list of strings) and it parses them.
_PASSTHROUGH = {"bench", "demo"}


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML config file (default: built-in defaults)")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. rollout.temperature=0.7"
    )


def build_parser() -> argparse.ArgumentParser:
    from megatron_tlt.config import RolloutConfig

    rollout = RolloutConfig()
    parser = argparse.ArgumentParser(
        prog="megatron-tlt",
        description="RL post-training on Megatron-Core with lossless adaptive speculative-decoding rollouts.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("train", help="the RL loop (the main job)")
    _add_config_args(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("sft", help="supervised warm-up of a policy (and drafter)")
    _add_config_args(p)
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser("generate", help="rollouts from prompts to a JSONL file")
    # The flags live beside the command's body so they cannot drift apart.
    from megatron_tlt.rollout.cli import add_generate_args

    add_generate_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("convert", help="checkpoint conversion between HF and Megatron-Core")
    conv = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    c = conv.add_parser("hf-to-mcore", help="HF safetensors -> Megatron-Core checkpoint")
    c.add_argument("--hf", required=True, metavar="DIR")
    c.add_argument("--out", required=True, metavar="DIR")
    c.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the output")
    c.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the output")
    c = conv.add_parser("mcore-to-hf", help="Megatron-Core checkpoint -> HF safetensors")
    c.add_argument("--mcore", required=True, metavar="DIR")
    c.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("eval", help="exact-answer rate on held-out synthetic prompts (greedy)")
    from megatron_tlt.evaluate import add_eval_args

    add_eval_args(p)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("export-drafter", help="export the drafter in HF EAGLE layout")
    p.add_argument("--ckpt", required=True, metavar="DIR", help="training checkpoint directory")
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(func=_cmd_export_drafter)

    # bench and demo parse their own flags (args.extra): -h / --help goes to that parser,
    # which lists them, instead of this one, which knows none of them
    p = sub.add_parser("bench", help="benchmarks (ratios measured in one run)", add_help=False)
    p.add_argument("-h", "--help", action="store_true", help="show the benchmark's own flags")
    p.add_argument("what", nargs="?", choices=["rollout", "spec", "e2e"])
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.set_defaults(func=_cmd_bench, parser=p)

    p = sub.add_parser("demo", help="a small end-to-end run on the built-in tiny model (CPU)",
                       add_help=False)
    p.set_defaults(func=_cmd_demo)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]), run the subcommand, return the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in _PASSTHROUGH:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    setup_logging(args.log_level)
    try:
        result = args.func(args)
    except NotAvailable as e:
        print(f"megatron-tlt {e}: not available in this build yet", file=sys.stderr)
        return EXIT_USER_ERROR
    except TLTError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return result if type(result) is int else 0


if __name__ == "__main__":
    sys.exit(main())
