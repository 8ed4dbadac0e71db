"""``python -m dkfac``: the ``dkfac`` command (the same as the console script)."""

import sys

from dkfac.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
