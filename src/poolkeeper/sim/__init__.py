"""The model-server simulator: a pure engine model, real-time servers, a virtual-time fleet."""
