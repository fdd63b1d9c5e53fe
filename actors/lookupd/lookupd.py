"""`python -m actors.lookupd`: the lookup daemon (nsqlookupd's role), and `Lookupd`.

The daemon is the actor runtime with no workers: one process besides the
supervisor (the gateway) hosts every actor, since a lookup daemon is small:

==================  ===========================================  ==================
name                actor                                        what it owns
==================  ===========================================  ==================
``listener:lookup`` `actors.lookupd.listener.ListenerActor`      the TCP V1 and HTTP loops
``peer:<id>``       `actors.lookupd.peer.PeerActor`              one broker's connection
``registry:lookup`` `actors.lookupd.registrar.RegistrarActor`    who has which topic
==================  ===========================================  ==================

The supervisor restarts the process if it dies (its brokers reconnect and
announce everything again) and an actor that raises (the registrar is
refilled by the peers).  Nothing is stored: as with nsqlookupd, the state is
what the brokers announce.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from functools import partial
from typing import Any

from actors.lookupd.listener import LISTENER, ListenerActor
from actors.lookupd.messages import ListenerInfo
from actors.lookupd.nodes import NODE_MODULES
from actors.lookupd.options import LookupdOptions, parse_options
from actors.lookupd.peer import PeerActor
from actors.lookupd.registrar import REGISTRAR, RegistrarActor
from actors.runtime.daemon import log_level, serve
from actors.runtime.placement import Placement
from actors.runtime.supervisor import Supervisor

__all__ = ["Lookupd", "main"]

log = logging.getLogger("actors.lookupd")



def _boot(node: str, placement: Placement) -> list[str]:
    return [LISTENER, REGISTRAR]


class Lookupd:
    """A running lookup daemon: ``with Lookupd(LookupdOptions(tcp_address=...)) as d:``."""

    def __init__(self, options: LookupdOptions) -> None:
        self.options = options.resolved()
        self.supervisor: Supervisor | None = None
        self.run_dir = ""
        self.tcp_port = 0
        self.http_port = 0

    def start(self) -> Lookupd:
        """Start the process and its listeners; RuntimeError (after stopping) if a
        listener cannot bind."""
        o = self.options
        self.run_dir = tempfile.mkdtemp(prefix="zmqnsq-lookupd-")
        factories: dict[str, Any] = {
            "listener": partial(ListenerActor, options=o),
            "registry": partial(RegistrarActor, options=o),
            "peer": PeerActor,
        }
        try:
            self.supervisor = Supervisor(
                self.run_dir, factories, workers=0, shutdown_timeout=o.shutdown_timeout,
                debug_hooks=o.debug_hooks, stop_order=("listener", "peer"), boot=_boot,
                log_level=log_level(o.log_level), preload=NODE_MODULES)
            self.supervisor.start()
            info = self.supervisor.ask(LISTENER, ListenerInfo(), 30)
            if info["error"]:
                raise RuntimeError(info["error"])
            self.tcp_port, self.http_port = info["tcp_port"], info["http_port"]
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def tcp_address(self) -> str:
        return f"{self.options.tcp_address.rpartition(':')[0]}:{self.tcp_port}"

    @property
    def http_address(self) -> str:
        return f"{self.options.http_address.rpartition(':')[0]}:{self.http_port}"

    def stop(self) -> bool:
        """Orderly shutdown; True if the process exited cleanly."""
        try:
            return self.supervisor.stop() if self.supervisor is not None else True
        finally:
            self.supervisor = None
            if self.run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> Lookupd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    return serve(argv, parse_options, Lookupd, log,
                 running=lambda daemon: f"lookupd running (pid {os.getpid()}): TCP on "
                                        f"{daemon.tcp_address}, HTTP on {daemon.http_address}")
