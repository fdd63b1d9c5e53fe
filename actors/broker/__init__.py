"""nsqd's role on the actor runtime: topics, channels, disk queues, clients, listeners.

``Broker`` embeds one (``with Broker(BrokerOptions(...)) as b: ...``);
``python -m actors.broker`` runs one in the foreground.  The module map is in
``docs/ARCHITECTURE.md``.
"""

from actors.broker.broker import Broker
from actors.broker.options import BrokerOptions

__all__ = ["Broker", "BrokerOptions"]
