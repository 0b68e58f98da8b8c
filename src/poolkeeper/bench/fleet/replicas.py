"""`python -m poolkeeper.bench.fleet.replicas`: the N-EPP-replica replay from the command line.

Argument parsing only. A replay (`run`, `replica_run.py`: what it models and reports) per
`--index` and `--replicas` value, printed as JSON rows; `--memory` measures the exact index's
memory instead, `--subscribers` its live feed's (`replica_memory.py`).

    python -m poolkeeper.bench.fleet.replicas [--workload shared-prefix] [--servers 8] \
        [--load 0.7] [--duration 120] \
        [--replicas 1 2 4] [--index approx exact] [--policy poolkeeper] \
        [--cold-affinity 0.2 [--cold-peers]] [--plugin-params JSON] [--sync-delay-ms 1]
    python -m poolkeeper.bench.fleet.replicas ... --cold-placement '{"balance": 1}'
    python -m poolkeeper.bench.fleet.replicas --memory [--endpoints 1000] [--blocks 1000] \
        [--chain 128] [--cap 31250]
    python -m poolkeeper.bench.fleet.replicas --memory --subscribers [--endpoints 1000]

`--cold-placement PARAMS`, `--plugin-params JSON`: `run`'s `cold_placement` and `plugin_params`
(`replica_run.py`); `--event-delay S`, `--sync-delay-ms D` and `--sync-without index drain
heads wake` and `--sync-with unseen [unseen-lora]`: its `event_delay_s`, `sync_delay_s` and
`sync_folds` (`replica_links.py`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace

from poolkeeper.bench.fleet.replica_memory import memory, subscriber_memory
from poolkeeper.bench.fleet.replica_run import run
from poolkeeper.bench.fleet.simrun import fleet_capacity
from poolkeeper.bench.workload.scenarios import build_scenario
from poolkeeper.bench.workload.workload_spec import WorkloadKind
from poolkeeper.flowcontrol.config import FlowControlConfig
from poolkeeper.scheduling.replicasync.config import ReplicaSyncConfig

# `serve`'s grace (its one home: the config field), so the replay models the shipped setup.
CLAIM_GRACE_MS: float = ReplicaSyncConfig.model_fields["claim_grace_ms"].default


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m poolkeeper.bench.fleet.replicas")
    parser.add_argument(
        "--workload",
        choices=[str(kind) for kind in WorkloadKind],
        default=str(WorkloadKind.SHARED_PREFIX),
        help="the scenario, as `bench sim` names it (default shared-prefix)",
    )
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--groups", type=int, default=None, help="prefix groups (default: the workload's)"
    )
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--policy",
        default="poolkeeper",
        help="each replica's policy (default poolkeeper: the default preset behind flow "
        "control, as `poolkeeper serve` runs it; poolkeeper-classic: the old default)",
    )
    parser.add_argument("--index", nargs="+", choices=["approx", "exact"], default=["approx"])
    parser.add_argument(
        "--cold-affinity", type=float, default=0.0, help="the prefix scorers' coldAffinity"
    )
    parser.add_argument(
        "--cold-peers",
        action="store_true",
        help="coldAffinityPeersOnly: cold affinity once the events show another replica",
    )
    parser.add_argument(
        "--prefix-params",
        type=json.loads,
        default=None,
        help="more prefix-cache-scorer parameters as JSON, e.g. '{\"coldAffinityLoadSlack\": 2}'",
    )
    parser.add_argument(
        "--cold-placement",
        type=json.loads,
        default=None,
        help="run a cold-placement-filter with these parameters as JSON, e.g. '{\"balance\": 1}'",
    )
    parser.add_argument(
        "--event-delay",
        type=float,
        default=0.0,
        help="seconds the engines' KV events take to reach the replicas (default 0)",
    )
    parser.add_argument(
        "--plugin-params",
        type=json.loads,
        default=None,
        help="plugin type -> parameters merged into the replicas' profile, as JSON, e.g. "
        '\'{"prefill-backlog-scorer": {"fadeFrom": 0.6}}\'',
    )
    parser.add_argument(
        "--sync-delay-ms",
        type=float,
        default=None,
        help="cross-replica sync, each replica's batches reaching the others this many ms "
        "later (default: no sync)",
    )
    parser.add_argument(
        "--sync-claim-ms",
        type=float,
        default=CLAIM_GRACE_MS,
        help="with --sync-delay-ms: the replicas' claimGraceMs (the room a peer's first byte "
        f"opened stays claimed in the hold's view this long; default {CLAIM_GRACE_MS:g}, as "
        "`serve`'s; 0: off)",
    )
    parser.add_argument(
        "--sync-without",
        nargs="+",
        choices=["index", "drain", "heads", "wake"],
        default=[],
        help="with --sync-delay-ms: parts of the fold left out (peers' blocks in the "
        "approximate index, their first bytes as drain samples, their pending heads, a "
        "peer's first byte or end waking the replica's pump)",
    )
    parser.add_argument(
        "--sync-with",
        nargs="+",
        choices=["unseen", "unseen-lora"],
        default=[],
        help="with --sync-delay-ms: parts of the fold turned on (unseen: the peers' sends since "
        "each endpoint's last scrape in the replica's unseen counts, as `serve` does by default, "
        "not in a pool serving LoRA adapters; unseen-lora: in such a pool too)",
    )
    parser.add_argument(
        "--flow-control",
        type=FlowControlConfig.model_validate_json,
        default=None,
        help="the replicas' spec.flowControl as JSON, e.g. "
        '\'{"holdNewPrefixes": {"placeUnderBacklog": false}}\' (default: the defaults)',
    )
    parser.add_argument("--memory", action="store_true", help="measure index memory only")
    parser.add_argument(
        "--subscribers", action="store_true", help="with --memory: the live feed's memory"
    )
    parser.add_argument("--endpoints", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument(
        "--chain", type=int, default=128, help="with --memory: blocks per reported chain"
    )
    parser.add_argument(
        "--cap",
        type=int,
        default=None,
        help="with --memory: the exact index's kvIndexMaxBlocksPerEndpoint (default: no bound)",
    )
    args = parser.parse_args(argv)
    if args.memory and args.subscribers:
        print(json.dumps(subscriber_memory(args.endpoints), indent=2))
        return 0
    if args.memory:
        print(json.dumps(memory(args.endpoints, args.blocks, args.chain, args.cap), indent=2))
        return 0
    scenario = build_scenario(args.workload, args.servers)
    if args.groups is not None:
        scenario = replace(scenario, spec=replace(scenario.spec, num_groups=args.groups))
    capacity = float(fleet_capacity(scenario, seed=args.seed)["capacity_rps"])
    rows = [
        run(
            n,
            servers=args.servers,
            load=args.load,
            duration=args.duration,
            seed=args.seed,
            capacity_rps=capacity,
            exact=kind == "exact",
            cold_affinity=args.cold_affinity,
            cold_peers=args.cold_peers and kind == "exact",
            prefix_params=args.prefix_params,
            groups=args.groups,
            cold_placement=args.cold_placement,
            event_delay_s=args.event_delay,
            policy=args.policy,
            plugin_params=args.plugin_params,
            sync_delay_s=None if args.sync_delay_ms is None else args.sync_delay_ms / 1000,
            sync_folds={
                **{part: False for part in args.sync_without},
                **{part: True for part in args.sync_with},
            }
            or None,
            sync_claim_s=args.sync_claim_ms / 1000,
            flow_control=args.flow_control,
            workload=args.workload,
        )
        for kind in args.index
        for n in args.replicas
    ]
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
