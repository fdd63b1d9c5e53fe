"""The broker's house: one package per daemon on a shared actor runtime.

``actors.runtime``  the generic actor runtime (``python -m actors.runtime``)
``actors.broker``   nsqd's role (``python -m actors.broker``)
``actors.ctl``      the operator's CLI (``python -m actors.ctl``)

Daemons import the runtime, ``transport`` and ``storage``; never each other.
See ``docs/ARCHITECTURE.md``.
"""
