"""``python -m actors.lookupd``: the lookup daemon in the foreground (see
:mod:`actors.lookupd.lookupd`)."""

from actors.lookupd.nodes import NODE_MODULES
from actors.runtime import forkserver

if __name__ == "__main__":
    forkserver.start(NODE_MODULES)  # (its imports beside ours: actors.runtime.forkserver)
    from actors.lookupd.lookupd import main

    forkserver.exit_now(main())
