"""The broker's house: one package per daemon on a shared actor runtime.

``actors.runtime``        the generic actor runtime (``python -m actors.runtime``)
``actors.broker``         nsqd's role (``python -m actors.broker``)
``actors.lookupd``        nsqlookupd's role (``python -m actors.lookupd``)
``actors.admin``          nsqadmin's role, the web console (``python -m actors.admin``)
``actors.ctl``            the operator's CLI (``python -m actors.ctl``)
``actors.cli``            ``zmqnsq``: NSQ's command-line tools in one
``actors.pytest_plugin``  the pytest plugin (``zmqnsq_broker``; docs/TESTING.md)

Daemons import the runtime, ``transport`` and ``storage``; never each other.
See ``docs/ARCHITECTURE.md``.
"""

__version__ = "0.1.0"
"""The package's version (setup.cfg reads it from here).  A constant, not
``importlib.metadata``: looking the installed version up imports ``email`` and
scans the installed distributions, 15 ms that the gateway's first listener
spent on every start, before ``/ping`` could answer."""
