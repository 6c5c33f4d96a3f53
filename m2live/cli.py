"""The ``m2live`` command. Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them and turns expected errors into one line and exit code 2."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module, one-line help). Modules must import without vLLM, torch or a GPU.
COMMANDS: dict[str, tuple[str, str]] = {
    "ops": ("m2live.commands.ops", "predict every row of an opbench-style per-operator CSV"),
    "validate": ("m2live.commands.validate", "MAPE of the predictor against every opbench CSV in a directory"),
    "predict": ("m2live.commands.predict", "predict one engine step with its full breakdown"),
    "gpus": ("m2live.commands.gpus", "list the GPU catalog"),
    "models": ("m2live.commands.models", "list the model presets and their shapes"),
    "probe": ("m2live.commands.probe", "measure clock droop and step times on this GPU; score the predictions"),
    "report": ("m2live.commands.report", "render a plugin step trace (JSONL) as a PNG report"),
    "rank": ("m2live.commands.rank", "rank GPU SKUs and TP layouts for a model and workload (capacity planning)"),
    "calibrate": ("m2live.commands.calibrate", "plan the shapes to measure on a GPU, fit its own constants on them"),
    "simulate": ("m2live.commands.simulate", "simulate vLLM serving at a fixed concurrency: TTFT, TPOT, tokens/s"),
    "config": ("m2live.commands.config", "check the plugin's effective configuration (file + M2LIVE_* environment)"),
}


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse with a bad command line reported as one line (exit 2), not the usage block above the error:
    ``--help`` still prints the usage. Subcommand parsers take this class from their parent."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _expected_errors() -> tuple[type[BaseException], ...]:
    from .hardware import UnknownGpuError
    from .shapes import ModelShapeError
    from .step import StepError

    # every OS error (a missing or unreadable path, a symlink loop, a name too long, a full disk) is the
    # environment's, said in one line; BrokenPipeError (a closed stdout) is handled before these
    return (CliError, UnknownGpuError, ModelShapeError, StepError, ValueError, OSError)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="m2live", description="Mechanistic per-step latency prediction "
                                     "for LLM serving engines.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip().splitlines()[0])
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def one_line(e: BaseException) -> str:
    """The error as one line: an OS error raised by open() as "PATH: reason" (not "[Errno 2] ... 'PATH'")."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror.lower()}" if e.filename is not None else e.strerror.lower()
    text = str(e).strip()
    return text.splitlines()[0] if text else e.__class__.__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # the library's warnings (a calibration fitted under an older model, a CPU device's re-measurement) as
    # "m2live COMMAND: warning: ..." lines on stderr, not bare messages
    log = logging.getLogger("m2live")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(f"m2live {args.command}: warning: %(message)s"))
    log.addHandler(handler)  # (a plugin's handler in the same process, as in tests, shows them in its own format too)
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:
        return 0
    except _expected_errors() as e:
        msg = one_line(e)
        print(f"m2live {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"m2live {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        log.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
