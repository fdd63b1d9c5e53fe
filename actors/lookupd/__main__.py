"""``python -m actors.lookupd``: the lookup daemon in the foreground (see
:mod:`actors.lookupd.lookupd`)."""

from actors.lookupd.nodes import NODE_MODULES
from actors.runtime import forkserver

if __name__ == "__main__":
    # (its imports beside ours: actors.runtime.forkserver)
    forkserver.start(NODE_MODULES, fork=True)
    from actors.lookupd.lookupd import main

    forkserver.exit_now(main())
