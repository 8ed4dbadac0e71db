"""``dkfac``: train, compare and benchmark distributed K-FAC from the command line.

The entry point: parse the arguments, run the command, and turn every failure a user can
act on into one line on stderr and an exit code (:mod:`dkfac.cli.exit_codes`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from dkfac.cli.commands import cmd_bench, cmd_compare, cmd_train
from dkfac.cli.exit_codes import (
    EXIT_SIGTERM,
    EXIT_USAGE,
    EXIT_WORKER,
    USAGE_ERRORS,
    WORKER_USAGE_ERRORS,
)
from dkfac.cli.launch import ExternalRank, external_rank, lost_peer_message
from dkfac.cli.launcher_signals import LauncherStopError, ignore_sigterm, sigterm_raises
from dkfac.cli.local_workers import WorkerError
from dkfac.cli.parser import build_parser
from dkfac.cli.rank_logging import configure_logging
from dkfac.cli.simulate import cmd_simulate


def _one_line(error: BaseException) -> str:
    """The message of ``error`` on one line (its whitespace runs made single spaces)."""
    return " ".join(str(error).split())


def missing_dependency_message(error: ImportError) -> str:
    """What is missing and what to install for ``error``, as one line."""
    message = _one_line(error)
    if "pip install" in message:  # the library already says what to install
        return message
    module = (error.name or "").partition(".")[0]
    package = {"sklearn": "scikit-learn", "yaml": "pyyaml"}.get(module, module)
    extras = "pip install 'dkfac[cli]' installs all of the command's optional dependencies"
    if not package:
        return f"{message} ({extras})"
    return f"{message}: pip install {package} ({extras})"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dkfac`` console script; returns the exit code.

    Without arguments it prints the help (``make demo`` runs ``dkfac compare``).
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not arguments:
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(arguments)
    except SystemExit as stop:  # --help, or the parser's one-line error
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)
    outside = external_rank()
    rank = 0 if outside is None else outside.rank
    configure_logging(rank)
    # Under torchrun every rank reports its own failure: say which one it is.
    error_prefix = "dkfac: error:" if rank == 0 else f"dkfac: [rank {rank}] error:"

    with sigterm_raises(outside is not None):
        return _run_reported(args, outside, error_prefix)


def _run_reported(args: argparse.Namespace, outside: ExternalRank | None, prefix: str) -> int:
    """Run the parsed command; failures, and a SIGTERM under a launcher, become one line."""

    def report(message: str) -> None:
        # One write per report: torchrun stops the survivors as soon as one worker fails, and a
        # line printed in pieces would be cut (or interleaved with another rank's) mid-way.
        if outside is not None:
            ignore_sigterm()
        sys.stderr.write(f"{prefix} {message}\n")
        sys.stderr.flush()

    commands = {
        "train": cmd_train,
        "compare": cmd_compare,
        "bench": cmd_bench,
        "simulate": cmd_simulate,
    }
    try:
        return _run_command(commands[args.command], args, report, outside is not None)
    except LauncherStopError as stop:  # also when it interrupts the handling of another error
        report(
            f"stopped by the launcher ({stop}): another worker failed (the launcher's report "
            "names it) or the job was cancelled"
        )
        return EXIT_SIGTERM


def _run_command(
    command: Callable[[argparse.Namespace], int],
    args: argparse.Namespace,
    report: Callable[[str], None],
    external: bool,
) -> int:
    """Run one command; every failure a user can act on becomes one reported line."""
    try:
        return command(args)
    except ImportError as error:
        report(missing_dependency_message(error))
        return EXIT_USAGE
    except USAGE_ERRORS as error:
        report(_one_line(error))
        return EXIT_USAGE
    except WorkerError as error:
        if isinstance(error.cause, ImportError):
            report(missing_dependency_message(error.cause))
            return EXIT_USAGE
        if isinstance(error.cause, WORKER_USAGE_ERRORS):  # bad input only a worker could see
            report(_one_line(error.cause))
            return EXIT_USAGE
        print(f"dkfac: {error}", file=sys.stderr)
        print(error.report(), file=sys.stderr)
        return EXIT_WORKER
    except KeyboardInterrupt:
        print("dkfac: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as error:  # under torchrun/Slurm: this rank's collective failed
        message = lost_peer_message(error) if external else None
        if message is None:
            raise
        report(message)
        return EXIT_WORKER


if __name__ == "__main__":
    raise SystemExit(main())
