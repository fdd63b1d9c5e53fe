"""nsqd's role on the actor runtime: topics, channels, disk queues, clients, listeners.

``Broker`` embeds one (``with Broker(BrokerOptions(...)) as b: ...``);
``python -m actors.broker`` runs one in the foreground.  The module map is in
``docs/ARCHITECTURE.md``.
"""

from typing import TYPE_CHECKING

from actors.runtime.lazy import attributes

if TYPE_CHECKING:
    from actors.broker.broker import Broker
    from actors.broker.options import BrokerOptions


# (imported on first use: ``python -m actors.broker`` starts the fork server first)
__getattr__ = attributes(__name__, {"Broker": "actors.broker.broker",
                                    "BrokerOptions": "actors.broker.options"})


__all__ = ["Broker", "BrokerOptions"]
