"""Model-server metrics: the Prometheus text reader, engine mappings and per-endpoint scrapers."""
