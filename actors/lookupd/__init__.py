"""nsqlookupd's role on the actor runtime: brokers announce, consumers look up.

``Lookupd`` embeds one (``with Lookupd(LookupdOptions(...)) as d: ...``);
``python -m actors.lookupd`` runs one in the foreground.  See docs/CLUSTER.md.
"""

from typing import TYPE_CHECKING

from actors.runtime.lazy import attributes

if TYPE_CHECKING:
    from actors.lookupd.lookupd import Lookupd
    from actors.lookupd.options import LookupdOptions


# (imported on first use: ``python -m actors.lookupd`` starts the fork server first)
__getattr__ = attributes(__name__, {"Lookupd": "actors.lookupd.lookupd",
                                    "LookupdOptions": "actors.lookupd.options"})


__all__ = ["Lookupd", "LookupdOptions"]
