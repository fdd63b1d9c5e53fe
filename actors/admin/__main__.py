"""``python -m actors.admin``: the web console in the foreground (see
:mod:`actors.admin.admin`)."""

import sys

from actors.admin.admin import main

if __name__ == "__main__":
    sys.exit(main())
