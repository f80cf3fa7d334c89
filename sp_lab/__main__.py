"""``python -m sp_lab ...``: the headless command line (see :mod:`sp_lab.cli`)."""

import sys

from sp_lab.cli import main

if __name__ == "__main__":
    sys.exit(main())
