"""What `poolkeeper quickstart` serves: the simulated fleet's base model and LoRA adapters, the
demo's client models with their criticality and share of the load (`DEMO_MODELS`), and the
resource file it writes (GatewayConfig with free ports, pool, InferenceModels with a 70/30
weighted split: `write_resources`)."""

from __future__ import annotations

from pathlib import Path

from poolkeeper.netutil import free_ports

BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ADAPTERS = ("food-review-v1", "food-review-v2", "tweet-summary-1", "tweet-summary-2")


# (client-facing model, criticality, share of the demo load)
DEMO_MODELS = (
    (BASE_MODEL, "Critical", 0.25),
    ("food-review", "Standard", 0.45),
    ("tweet-summary", "Sheddable", 0.30),
)

RESOURCES = """\
apiVersion: poolkeeper.dev/v1alpha1
kind: GatewayConfig
metadata: {{name: quickstart}}
spec:
  listeners: {{http: {http}, extProc: {ext_proc}, metrics: {metrics}, health: {health},
    admin: {admin}}}
  scraping: {{intervalMs: 50, timeoutMs: 1000}}
  endpoints:
{endpoints}---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {{name: quickstart-pool, namespace: default}}
spec:
  selector: {{app: quickstart-sim}}
  targetPortNumber: 8000
  extensionRef: {{name: quickstart-epp, failureMode: FailClose}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: base, namespace: default}}
spec:
  modelName: {base}
  criticality: Critical
  poolRef: {{name: quickstart-pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: food-review, namespace: default}}
spec:
  modelName: food-review
  criticality: Standard
  targetModels:
    - {{name: food-review-v1, weight: 70}}
    - {{name: food-review-v2, weight: 30}}
  poolRef: {{name: quickstart-pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {{name: tweet-summary, namespace: default}}
spec:
  modelName: tweet-summary
  criticality: Sheddable
  targetModels:
    - {{name: tweet-summary-1}}
    - {{name: tweet-summary-2}}
  poolRef: {{name: quickstart-pool}}
"""


def write_resources(directory: Path, sim_ports: list[int]) -> dict[str, int]:
    http, ext_proc, metrics, health, admin = free_ports(5)
    endpoints = "".join(
        f"    - {{name: sim-{i}, address: 127.0.0.1, port: {port}, "
        "labels: {app: quickstart-sim}}\n"
        for i, port in enumerate(sim_ports)
    )
    ports = {"http": http, "ext_proc": ext_proc, "metrics": metrics, "health": health,
             "admin": admin}  # fmt: skip
    text = RESOURCES.format(endpoints=endpoints, base=BASE_MODEL, **ports)
    (directory / "quickstart.yaml").write_text(text)
    return ports
