"""``python -m actors.runtime``: the runtime in the foreground (see :mod:`actors.runtime.main`)."""

import sys

from actors.runtime.main import main

if __name__ == "__main__":
    sys.exit(main())
