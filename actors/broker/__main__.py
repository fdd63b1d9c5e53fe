"""``python -m actors.broker``: the broker in the foreground (see :mod:`actors.broker.broker`)."""

from actors.broker.nodes import NODE_MODULES
from actors.runtime import forkserver

if __name__ == "__main__":
    # The fork server imports what the nodes run while this process imports the
    # supervisor's side: two cores, two imports at once (actors.runtime.forkserver).
    forkserver.start(NODE_MODULES, fork=True)
    from actors.broker.broker import main

    forkserver.exit_now(main())
