"""nsqd's and nsqlookupd's HTTP APIs, the HTTP/1.1 server they run on (``web``), and the
renderings of stats: Prometheus ``/metrics`` and text ``/stats``."""
