"""Gateway configuration: the GatewayConfig document (`poolkeeper.dev/v1alpha1`)."""
