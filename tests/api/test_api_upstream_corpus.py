"""Upstream's own sample and conformance manifests, v0.1.0 to v1.6.0, load as upstream's API
server would take them.

`tests/api/upstream_corpus/` holds the InferencePool/InferenceModel/InferenceObjective/
InferenceModelRewrite documents of these files of
kubernetes-sigs/gateway-api-inference-extension, unchanged (each file names its source):

- `test/testdata/inferencepool-with-model-hermetic.yaml@v0.1.0` (pool + model v1alpha1)
- `pkg/manifests/ext_proc.yaml@v0.1.0` (pool v1alpha1, `labels:` left empty)
- `config/manifests/ext_proc.yaml@v0.2.0` (pool v1alpha2)
- `config/manifests/inferencepool-resources.yaml@v0.3.0`,
  `config/manifests/inferencemodel.yaml@v0.3.0`
- `conformance/tests/basic/inferencepool_resolvedrefs_condition.yaml@v0.4.0`
- `conformance/resources/manifests/manifests.yaml@v0.5.1` (FailOpen pool)
- `conformance/resources/base.yaml@v1.0.0` and `@v1.5.0` (pool v1, h2c, 3 DP ports)
- `conformance/tests/inferencepool_missing_epp_ref.yaml@v1.6.0` (no endpointPickerRef)
- `config/manifests/inferenceobjective.yaml@v1.0.0` and `@v1.5.0` (InferenceObjective)
- `site-src/guides/adapter-rollout.md@v1.5.0` (its 90/10 InferenceModelRewrite)

and one that upstream's CRD rejects (`config/samples/gateway_v1alpha1_inferencepool.yaml@v0.1.0`
has no `extensionRef`), which poolkeeper must reject too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from poolkeeper.api.load import load_paths, load_text
from poolkeeper.api.pool import InferencePool, InferencePoolV1, InferencePoolV1Alpha1
from tests.api.crd_oracle import oracle_errors

CORPUS = Path(__file__).parent / "upstream_corpus"
ACCEPTED = sorted(p for p in CORPUS.glob("v*.yaml"))
REJECTED = sorted(p for p in CORPUS.glob("rejected_*.yaml"))


def test_corpus_spans_every_era() -> None:
    tags = {p.name.split("_", 1)[0] for p in ACCEPTED}
    assert {"v0.1.0", "v0.2.0", "v0.3.0", "v0.4.0", "v0.5.1", "v1.0.0", "v1.6.0"} <= tags
    assert REJECTED


@pytest.mark.parametrize("path", ACCEPTED, ids=[p.stem for p in ACCEPTED])
def test_upstream_manifest_loads(path: Path) -> None:
    result = load_paths([path])
    assert result.errors == []
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert len(result.resources) == len(docs)
    for doc in docs:
        assert oracle_errors(doc, None) == [], doc["metadata"]  # the CRD schema agrees


@pytest.mark.parametrize("path", REJECTED, ids=[p.stem for p in REJECTED])
def test_manifest_upstream_rejects_is_rejected(path: Path) -> None:
    result = load_paths([path])
    assert [e.path for e in result.errors] == ["spec.extensionRef"]


def test_v1alpha1_pool_of_the_seed_era() -> None:
    result = load_paths([CORPUS / "v0.1.0_test_testdata_inferencepool-with-model-hermetic.yaml"])
    (pool,) = result.pools()
    assert isinstance(pool, InferencePoolV1Alpha1)
    assert (pool.key, pool.target_ports(), pool.selector()) == (
        "default/vllm-llama2-7b-pool",
        (8000,),
        {"app": "vllm-llama2-7b-pool"},
    )
    assert pool.endpoint_picker().name == "epp"
    (model,) = result.models()
    assert model.pool_key == pool.key


def test_v1_pool_without_endpoint_picker_ref() -> None:
    result = load_paths([CORPUS / "v1.6.0_conformance_tests_inferencepool_missing_epp_ref.yaml"])
    (pool,) = result.pools()
    assert isinstance(pool, InferencePoolV1)
    assert pool.spec.endpoint_picker_ref is None
    assert pool.failure_mode() == "FailClose"


# A v0.2-v0.4 pool as `kubectl get -o yaml` shows it once a gateway wrote status: `parentRef`
# is a `corev1.ObjectReference` (api/v1alpha2/inferencepool_types.go@v0.4.0).
OBJECT_REFERENCE_STATUS = """
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {name: pool, namespace: default, uid: 3b0b7c52-5a8e-4d0c-9a51-0d1b8e2f6a10}
spec:
  selector: {app: vllm}
  targetPortNumber: 8000
  extensionRef: {name: epp}
status:
  parent:
  - parentRef:
      apiVersion: gateway.networking.k8s.io/v1
      kind: Gateway
      name: inference-gateway
      namespace: default
      uid: 8d5e2f8e-9b4f-4a39-8f0e-4a6c1f5b2c77
      resourceVersion: "1234"
    conditions:
    - type: Accepted
      status: "True"
      reason: Accepted
      message: ""
      lastTransitionTime: "2025-04-02T10:00:00Z"
"""


def test_v0_2_to_v0_4_status_with_object_reference_loads() -> None:
    result = load_text(OBJECT_REFERENCE_STATUS)
    assert result.errors == []
    (pool,) = result.pools()
    assert isinstance(pool, InferencePool)
    assert pool.status is not None
    ref = pool.status.parent[0].parent_ref
    assert (ref.api_version, ref.kind, ref.name) == (
        "gateway.networking.k8s.io/v1",
        "Gateway",
        "inference-gateway",
    )
