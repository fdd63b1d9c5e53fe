"""nsqd's HTTP API (aiohttp) and its renderings: Prometheus ``/metrics`` and text ``/stats``."""
