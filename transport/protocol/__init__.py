"""What NSQ V2 and the ZeroMQ protocol share: commands, validation and limits, IDENTIFY."""
