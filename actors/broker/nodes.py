"""What the broker's node processes run: the fork server imports them once
(actors.runtime.forkserver), before it forks the gateway and the workers.

Kept apart from the package's other modules: ``python -m actors.broker`` reads
it before it imports anything else, to start the fork server at once.
"""

NODE_MODULES = ("actors.broker.broker", "transport.http.api", "transport.nsq.server",
                "transport.zmq.server")

__all__ = ["NODE_MODULES"]
