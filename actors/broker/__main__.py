"""``python -m actors.broker``: the broker in the foreground (see :mod:`actors.broker.broker`)."""

import sys

from actors.broker.broker import main

if __name__ == "__main__":
    sys.exit(main())
