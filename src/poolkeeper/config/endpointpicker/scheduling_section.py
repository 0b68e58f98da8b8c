"""The `scheduling` section an EndpointPickerConfig means, with upstream's system defaults.

Scheduling plugins keep their names and weights; pickers keep `maxNumOfEndpoints`;
`prefix-cache-scorer` takes its block size, match length and LRU size from the
`approx-prefix-cache-producer` that feeds it (tokens -> poolkeeper's 4-character tokens). No
profiles means one `default` profile with every filter, scorer and picker; a profile without a
picker gets `max-score-picker`. Also the request handler's parser references (`check_parsers`).
"""

from __future__ import annotations

import math
from typing import Any

from poolkeeper.config.endpointpicker.catalogue import (
    UPSTREAM_PLUGINS,
    ApproxPrefixParams,
    PickerParams,
    PrefixScorerParams,
    Role,
    Use,
)
from poolkeeper.config.endpointpicker.document import EndpointPickerConfig, PluginSpec
from poolkeeper.config.endpointpicker.translation_work import (
    TranslationWork,
    one_of,
    role_of,
)

_PROFILE_ROLES = (Role.FILTER, Role.SCORER, Role.PICKER)
_TOKEN_CHARS = 4  # poolkeeper's approximate tokenizer (tokens.py)


def prefix_params(scorer: PrefixScorerParams, work: TranslationWork) -> dict[str, Any]:
    """poolkeeper prefix-cache-scorer parameters from the producer that feeds the scorer."""
    if scorer.match_length_weight != 0:
        work.problems.append(
            "prefix-cache-scorer: matchLengthWeight > 0 is not implemented by poolkeeper "
            "(its score is matched blocks / prompt blocks, upstream's weight 0)"
        )
    producers = [
        n
        for n, s in work.specs.items()
        if s is not None and s.type_name == "approx-prefix-cache-producer"
    ]
    wanted = scorer.prefix_match_info_producer_name
    if wanted and wanted not in producers:
        work.problems.append(
            f"prefix-cache-scorer: prefixMatchInfoProducerName {wanted!r} is not an "
            "approx-prefix-cache-producer in plugins"
        )
        return {}
    chosen = wanted or (producers[0] if producers else None)
    if chosen is None:
        return {}
    producer = work.params.get(chosen)
    if not isinstance(producer, ApproxPrefixParams):
        return {}
    out: dict[str, Any] = {}
    tokens_per_block = producer.block_size_tokens or 16
    if producer.block_size is not None:  # deprecated, in characters
        out["blockSize"] = producer.block_size
        tokens_per_block = max(1, producer.block_size // _TOKEN_CHARS)
    elif producer.block_size_tokens is not None:
        out["blockSize"] = producer.block_size_tokens * _TOKEN_CHARS
    if producer.max_prefix_tokens_to_match is not None:
        out["maxPrefixBlocks"] = math.ceil(producer.max_prefix_tokens_to_match / tokens_per_block)
    elif producer.max_prefix_blocks_to_match is not None:
        out["maxPrefixBlocks"] = producer.max_prefix_blocks_to_match
    if producer.lru_capacity_per_server is not None:
        out["lruCapacityPerServer"] = producer.lru_capacity_per_server
    if producer.auto_tune:
        work.notices.append(
            f"{chosen}: autoTune is not implemented; the block size stays "
            f"{out.get('blockSize', 64)} characters"
        )
    return out


def scheduling_section(config: EndpointPickerConfig, work: TranslationWork) -> dict[str, Any]:
    plugins: list[dict[str, Any]] = []
    for name, spec in work.specs.items():
        raw = work.raw[name]
        if spec is None:
            plugins.append({"type": raw.type, "name": name, "parameters": raw.parameters or {}})
            continue
        if spec.use is not Use.SCHEDULING:
            continue
        params = work.params.get(name)
        parameters: dict[str, Any] = {}
        if isinstance(params, PickerParams):
            count = params.max_num_of_endpoints
            parameters["maxNumOfEndpoints"] = count if 1 <= count <= 64 else 1
        elif isinstance(params, PrefixScorerParams):
            parameters = prefix_params(params, work)
        plugins.append({"type": spec.type_name, "name": name, "parameters": parameters})
    schedulable = [p["name"] for p in plugins if role_of(p["name"], work) in _PROFILE_ROLES]
    profiles: list[dict[str, Any]] = [
        {
            "name": p.name,
            "plugins": [r.model_dump(by_alias=True, exclude_none=True) for r in p.plugins],
        }
        for p in config.scheduling_profiles
    ] or [{"name": "default", "plugins": [{"pluginRef": n} for n in schedulable]}]
    for i, profile in enumerate(profiles):
        refs = [r["pluginRef"] for r in profile["plugins"]]
        for j, ref in enumerate(refs):
            if ref not in work.raw:
                work.problems.append(
                    f"schedulingProfiles[{i}].plugins[{j}]: unknown plugin {ref!r}"
                )
            elif role_of(ref, work) not in _PROFILE_ROLES:
                work.problems.append(
                    f"schedulingProfiles[{i}].plugins[{j}]: {ref!r} is not a filter, scorer or "
                    "picker"
                )
        if not any(role_of(r, work) is Role.PICKER for r in refs if r in work.raw):
            picker = "max-score-picker"
            if picker not in work.raw:
                plugins.append(
                    {"type": picker, "name": picker, "parameters": {"maxNumOfEndpoints": 1}}
                )
                work.raw[picker] = PluginSpec(type=picker)
                work.specs[picker] = UPSTREAM_PLUGINS[picker]
            profile["plugins"].append({"pluginRef": picker})
    handlers = [n for n in work.raw if role_of(n, work) is Role.PROFILE_HANDLER]
    if len(profiles) > 1:
        work.problems.append(
            f"schedulingProfiles: {len(profiles)} profiles need a multi-profile handler "
            "(disagg-profile-handler), which poolkeeper does not implement; use one profile"
        )
    section: dict[str, Any] = {"plugins": plugins, "schedulingProfiles": profiles}
    if len(handlers) > 1:
        work.problems.append("plugins: more than one profile handler")
    elif handlers:
        section["profileHandler"] = handlers[0]
    return section


def check_parsers(config: EndpointPickerConfig, work: TranslationWork) -> None:
    refs = list(config.request_handler.parsers) if config.request_handler else []
    if not refs and config.parser is not None:
        refs = [config.parser]
    for i, ref in enumerate(refs):
        where = f"requestHandler.parsers[{i}].pluginRef"
        one_of(Role.PARSER, work, ref.plugin_ref, where)
