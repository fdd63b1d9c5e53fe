"""``python -m actors.lookupd``: the lookup daemon in the foreground (see
:mod:`actors.lookupd.lookupd`)."""

import sys

from actors.lookupd.lookupd import main

if __name__ == "__main__":
    sys.exit(main())
