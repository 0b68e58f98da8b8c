"""Resource sources (files today, Kubernetes later) that feed the datastore and compute status."""
