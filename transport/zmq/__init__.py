"""Our ZeroMQ client protocol (docs/PROTOCOL.md): the sans-IO codec, the ROUTER loop, framing."""
