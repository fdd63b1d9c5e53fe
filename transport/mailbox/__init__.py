"""How actors talk between processes: msgpack envelopes and ZeroMQ mailbox sockets."""
