"""The lean ext_proc transport: HTTP/2 and gRPC framing written for the EPP's few methods.

grpc.aio costs about 1 ms per ext_proc request behind Envoy (docs/gateway.md, Transport):
`frames` is the HTTP/2 frame codec, `limits` the defences, `connection` one connection's state
machine, `rpc` the gRPC side of a stream, and `server` the listener with drain and metrics.
"""
