"""nsqlookupd's role on the actor runtime: brokers announce, consumers look up.

``Lookupd`` embeds one (``with Lookupd(LookupdOptions(...)) as d: ...``);
``python -m actors.lookupd`` runs one in the foreground.  See docs/CLUSTER.md.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.lookupd.lookupd import Lookupd
    from actors.lookupd.options import LookupdOptions


def __getattr__(name: str) -> Any:
    # (PEP 562: ``python -m actors.lookupd`` starts the fork server before these imports)
    if name == "Lookupd":
        from actors.lookupd.lookupd import Lookupd  # noqa: PLC0415

        return Lookupd
    if name == "LookupdOptions":
        from actors.lookupd.options import LookupdOptions  # noqa: PLC0415

        return LookupdOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Lookupd", "LookupdOptions"]
