"""Cross-replica sync's part of the generated deployment (pure dicts and text; `deploy_objects.py`
puts them in the EPP's objects, docs/kubernetes.md "Active-active replicas with sync").

On in the shipped deployment, keyed by a Secret nobody commits: the GatewayConfig has
`replicaSync.enabled: true` with `keyOptional: true`, and the Deployment mounts the Secret
`<pool>-epp-sync` as an optional volume. Why not a key in the files: `deploy/` is committed and
public, and a key written at render time would end up in every GitOps repository that stores
the rendered output; and the EPP creating its own Secret would need write access to Secrets,
which its least-privilege Role does not have. So the one step left is the operator's: create
the Secret with a random key (before applying, and the replicas sync from their first start;
after, and they start syncing once the kubelet has mounted it, without a restart). Until then
each replica starts and routes alone, with a warning that names the command
(`server/sync_keys.key_missing`); sync never runs unauthenticated.

Also here: the headless Service naming every replica (`replicaSync.peerService`), and the
NetworkPolicy that keeps everyone but the EPP's own Pods off the sync port.
"""

from __future__ import annotations

from typing import Any

from poolkeeper.cli.deploy_params import SYNC_KEY_DIR, SYNC_PORT, DeployParams, labels, meta


def sync_section(p: DeployParams) -> str:
    """The GatewayConfig's `replicaSync` (indented under `spec:`)."""
    return f"""\
  # Cross-replica sync (docs/kubernetes.md, "Active-active replicas with sync"): on once the
  # Secret {p.sync_secret} holds a random key (never commit one); until then each replica
  # routes alone and says so at start:
  #   kubectl -n {p.namespace} create secret generic {p.sync_secret} \\
  #     --from-literal=key="$(head -c 32 /dev/urandom | base64)"
  # Running replicas start syncing once the kubelet has mounted it (about a minute): no
  # restart. Rotating it: docs/kubernetes.md, "Rotating the sync key".
  replicaSync:
    enabled: true
    keyOptional: true
    port: {SYNC_PORT}
    peerService: {p.peers_service}.{p.namespace}.svc
    keyFile: {SYNC_KEY_DIR}/key
"""


def key_volume(p: DeployParams) -> dict[str, Any]:
    # Optional: without the Secret the pod starts, and sync stays off (keyOptional).
    return {"name": "sync-key", "secret": {"secretName": p.sync_secret, "optional": True}}


def key_mount() -> dict[str, Any]:
    return {"name": "sync-key", "mountPath": SYNC_KEY_DIR, "readOnly": True}


def peers_service(p: DeployParams) -> dict[str, Any]:
    """Headless: its name resolves to every replica's Pod IP (replicaSync.peerService);
    starting replicas too, so they hear the others' sends before taking traffic."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(p.peers_service, p, labels=labels(p)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(p),
            "ports": [{"name": "sync", "port": SYNC_PORT, "targetPort": "sync", "protocol": "UDP"}],
        },
    }


def sync_policy(p: DeployParams) -> dict[str, Any]:
    """Only the EPP's own Pods may reach its sync port: anyone else's datagrams would cost a
    lookup each (the transport drops non-peers before their tag), but need not arrive at all.
    Every TCP port stays open to all, as without the policy (ext-proc, health, metrics). Takes
    effect where the cluster's network plugin enforces NetworkPolicies."""
    own = labels(p)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(f"{p.epp}-sync-ingress", p, labels=own),
        "spec": {
            "podSelector": {"matchLabels": own},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP"}]},
                {
                    "from": [{"podSelector": {"matchLabels": own}}],
                    "ports": [{"protocol": "UDP", "port": SYNC_PORT}],
                },
            ],
        },
    }
