"""The ``dkfac`` command: ``train``, ``compare`` (default) and the helpers behind them."""

from dkfac.cli.main import main

__all__ = ["main"]
