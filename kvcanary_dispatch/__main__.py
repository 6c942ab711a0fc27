"""``python -m kvcanary_dispatch``: the same as the ``kvcanary-dispatch`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
