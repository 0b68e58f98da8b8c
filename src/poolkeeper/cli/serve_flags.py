"""The flag groups of `poolkeeper serve` (and `-f` of `envoy-config`): resource files,
Kubernetes mode, TLS on the ext_proc port. What the flags mean is `serve_setup`."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_file_flags(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "-f",
        "--filename",
        dest="paths",
        action="extend",
        nargs="+",
        required=required,
        metavar="PATH",
        help="YAML/JSON files or directories with InferencePools, InferenceModels and an "
        "optional GatewayConfig (with --kubernetes: only the GatewayConfig)",
    )


def add_kubernetes_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Kubernetes mode")
    group.add_argument(
        "--kubernetes",
        action="store_true",
        help="read pools, models and Pods from the Kubernetes API server and write model "
        "status (implies --no-envoy: the cluster's Gateway is the Envoy)",
    )
    group.add_argument(
        "--kubeconfig", type=Path, default=None, help="kubeconfig file (default: in-cluster)"
    )
    group.add_argument("--context", default=None, help="kubeconfig context")
    group.add_argument(
        "--namespace", default=None, help="namespace to watch (default: the pod's own)"
    )
    group.add_argument(
        "--pool",
        dest="pools",
        action="append",
        default=[],
        metavar="NAME",
        help="serve only this InferencePool (repeatable; default: every pool in the namespace)",
    )
    group.add_argument(
        "--identity",
        default=None,
        help="this replica's name for the Lease (default: $POD_NAME, else the host name)",
    )
    group.add_argument(
        "--lease-name", default="poolkeeper-epp", help="Lease for the status writer election"
    )
    group.add_argument("--no-status", action="store_true", help="never write InferenceModel status")
    group.add_argument(
        "--metrics-endpoint-auth",
        action="store_true",
        help="/metrics only for a bearer token the API server authenticates (TokenReview) "
        "and allows to get /metrics (SubjectAccessReview), as upstream's EPP; needs a "
        "ClusterRole to create both",
    )


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS on the ext_proc port (upstream's EPP flags)")
    group.add_argument(
        "--secure-serving",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve ext_proc over TLS, ALPN h2 (default: on with --kubernetes, as upstream's "
        "EPP; otherwise off, loopback plaintext to the managed Envoy)",
    )
    group.add_argument(
        "--cert-path",
        type=Path,
        default=None,
        help="directory with tls.crt and tls.key (default: a self-signed cert made at start)",
    )
    group.add_argument(
        "--enable-cert-reload",
        action="store_true",
        help="serve a changed tls.crt/tls.key from the next connection on (needs --cert-path)",
    )
    group.add_argument(
        "--client-ca-file",
        type=Path,
        default=None,
        help="mutual TLS: require a client certificate chained to a CA in this PEM file "
        "(poolkeeper's own flag; the EPP behind another host's Envoy: --kubernetes or "
        "--no-envoy)",
    )
    group.add_argument(
        "--tls-min-version",
        default="",
        help="VersionTLS10..VersionTLS12 (gRPC serves TLS 1.2 and up in any case)",
    )
    group.add_argument(
        "--tls-cipher-suites",
        default="",
        help="comma list (accepted for upstream's flag; grpcio cannot apply one: refused)",
    )
