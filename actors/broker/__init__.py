"""nsqd's role on the actor runtime: topics, channels, disk queues, clients, listeners.

``Broker`` embeds one (``with Broker(BrokerOptions(...)) as b: ...``);
``python -m actors.broker`` runs one in the foreground.  The module map is in
``docs/ARCHITECTURE.md``.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.broker.broker import Broker
    from actors.broker.options import BrokerOptions


def __getattr__(name: str) -> Any:
    # (PEP 562: ``python -m actors.broker`` starts the fork server before these imports)
    if name == "Broker":
        from actors.broker.broker import Broker  # noqa: PLC0415

        return Broker
    if name == "BrokerOptions":
        from actors.broker.options import BrokerOptions  # noqa: PLC0415

        return BrokerOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Broker", "BrokerOptions"]
