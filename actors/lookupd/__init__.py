"""nsqlookupd's role on the actor runtime: brokers announce, consumers look up.

``Lookupd`` embeds one (``with Lookupd(LookupdOptions(...)) as d: ...``);
``python -m actors.lookupd`` runs one in the foreground.  See docs/CLUSTER.md.
"""

from actors.lookupd.lookupd import Lookupd
from actors.lookupd.options import LookupdOptions

__all__ = ["Lookupd", "LookupdOptions"]
