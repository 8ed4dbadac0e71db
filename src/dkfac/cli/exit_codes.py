"""Exit codes of the ``dkfac`` command, and which exceptions count as bad input (code 2)."""

from __future__ import annotations

from dkfac.cli.config import ConfigError

EXIT_USAGE = 2
EXIT_WORKER = 1
EXIT_SIGTERM = 128 + 15  # what a shell reports for a process ended by SIGTERM
#: Bad input, whether the parent or a worker found it: one line on stderr and exit code 2.
USAGE_ERRORS: tuple[type[Exception], ...] = (ConfigError, FileNotFoundError, ValueError)
#: Bad input as a worker reports it. Not any ValueError: the parent has validated the
#: configuration and the data before starting workers, so a plain ValueError there is a bug
#: whose traceback the user needs (exit code 1).
WORKER_USAGE_ERRORS: tuple[type[Exception], ...] = (ConfigError, FileNotFoundError)
