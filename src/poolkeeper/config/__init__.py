"""Gateway configuration: the GatewayConfig document (`poolkeeper.dev/v1alpha1`), gathering the
sections the packages below declare, and the loader that adds it to the API kinds (`load.py`)."""
