"""What the lookup daemon's node process runs: the fork server imports it once
(actors.runtime.forkserver).

Kept apart from the package's other modules: ``python -m actors.lookupd`` reads
it before it imports anything else, to start the fork server at once.
"""

NODE_MODULES = ("actors.lookupd.lookupd", "transport.http.lookup_api",
                "transport.nsq.lookup_server")

__all__ = ["NODE_MODULES"]
