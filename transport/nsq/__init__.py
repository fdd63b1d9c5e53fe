"""NSQ's TCP protocol V2: the sans-IO codecs (server and client side) and the socket loop."""
