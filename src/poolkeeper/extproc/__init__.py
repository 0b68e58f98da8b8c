"""Envoy ext_proc front end of the Endpoint Picker: wire protocol only; a router decides."""
