"""``python -m chorus ...`` is the ``chorus`` command."""

import sys

from chorus.cli import main

if __name__ == "__main__":
    sys.exit(main())
