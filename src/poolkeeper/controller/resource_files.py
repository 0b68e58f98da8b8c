"""Reading the resource files: `load_files` is the one reader (`serve`, `envoy-config` and the
file source's hot reload all go through it). It validates every document with the API loader,
allows at most one GatewayConfig (or one EndpointPickerConfig, translated), resolves the
GatewayConfig's standalone endpoints (`endpoint_specs`) and records which file holds which
resources, so a deleted file that took resources with it is an error (`deleted_file_errors`).
`fingerprint` is what the hot reload polls. Applying a load is `files.FileResourceSource`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from pydantic import ValidationError

from poolkeeper.api.fielderrors import from_pydantic
from poolkeeper.api.load import SUFFIXES
from poolkeeper.api.load_results import LoadedResource, LoadResult
from poolkeeper.api.model import InferenceModel
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.config.endpointpicker.checked import CheckedEndpointPickerConfig
from poolkeeper.config.endpointpicker.replicasync import key_context
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.config.load import load_paths
from poolkeeper.datastore.models import ModelResource
from poolkeeper.datastore.snapshot import EndpointSpec

Fingerprint = tuple[tuple[str, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class LoadedFiles:
    """Everything one read of the resource files produced; `errors` empty when usable."""

    pools: tuple[AnyInferencePool, ...]
    models: tuple[InferenceModel, ...]
    specs: tuple[EndpointSpec, ...]
    gateway_config: GatewayConfig  # the default one when the files have none
    notices: tuple[str, ...]
    errors: tuple[str, ...]
    policies: tuple[ModelResource, ...] = ()  # InferenceObjectives and InferenceModelRewrites
    # file -> refs of its resources
    held: Mapping[str, frozenset[str]] = field(default_factory=lambda: MappingProxyType({}))


def load_files(paths: Sequence[str | Path]) -> LoadedFiles:
    """Read and validate every resource in `paths` (files or directories); never raises for
    bad content: each problem is one line of `errors` (file, object, field path)."""
    result: LoadResult = load_paths(paths)
    errors = [str(e) for e in result.errors]
    configs = [r for r in result.resources if isinstance(r.obj, GatewayConfig)]
    gateway_config: GatewayConfig | None = None
    specs: tuple[EndpointSpec, ...] = ()
    if len(configs) > 1:
        places = ", ".join(f"{r.location} ({r.ref})" for r in configs)
        errors.append(f"more than one GatewayConfig: {places}")
    elif configs:
        assert isinstance(configs[0].obj, GatewayConfig)
        gateway_config = configs[0].obj
    notices = list(result.notices)
    picker_configs = [r for r in result.resources if isinstance(r.obj, CheckedEndpointPickerConfig)]
    if picker_configs and (configs or len(picker_configs) > 1):
        places = ", ".join(
            f"{r.location} ({type(r.obj).__name__})" for r in (*configs, *picker_configs)
        )
        errors.append(f"give one GatewayConfig or one EndpointPickerConfig, not several: {places}")
    elif picker_configs:
        gateway_config = _from_endpoint_picker_config(picker_configs[0], errors, notices)
    if gateway_config is not None:
        where = f"{configs[0].location}: {configs[0].ref}" if configs else "GatewayConfig"
        specs, spec_errors = endpoint_specs(gateway_config, where)
        errors.extend(spec_errors)
    return LoadedFiles(
        pools=tuple(result.pools()),
        models=tuple(result.models()),
        specs=specs,
        # Built only when the files have none: validating one resolves its scheduling section.
        gateway_config=gateway_config if gateway_config is not None else GatewayConfig.default(),
        notices=tuple(notices),
        errors=tuple(errors),
        policies=(*result.objectives(), *result.rewrites()),
        held=MappingProxyType(_held(result)),
    )


def _from_endpoint_picker_config(
    loaded: LoadedResource, errors: list[str], notices: list[str]
) -> GatewayConfig | None:
    """The GatewayConfig an EndpointPickerConfig means (its scheduling, scraping, admission and
    flow-control sections; everything else at GatewayConfig's defaults)."""
    assert isinstance(loaded.obj, CheckedEndpointPickerConfig)
    translation = loaded.obj.translation
    notices.extend(f"{loaded.location}: {notice}" for notice in translation.notices)
    try:
        return GatewayConfig.model_validate(
            {"spec": dict(translation.sections)},
            context=key_context(translation.key_file_at, loaded.location),
        )
    except ValidationError as exc:
        errors.extend(f"{loaded.location}: {e}" for e in from_pydantic(exc))
        return None


def _held(result: LoadResult) -> dict[str, frozenset[str]]:
    refs: dict[str, set[str]] = {}
    for resource in result.resources:
        refs.setdefault(resource.source, set()).add(resource.ref)
    return {source: frozenset(names) for source, names in refs.items()}


def deleted_file_errors(before: Mapping[str, frozenset[str]], now: LoadedFiles) -> tuple[str, ...]:
    """Files of the last good load that are gone, taking resources with them: one error each
    (a deletion that was not confirmed by emptying the file first)."""
    present = frozenset().union(*now.held.values()) if now.held else frozenset()
    errors = []
    for source, refs in sorted(before.items()):
        lost = sorted(refs - present)
        if source not in now.held and lost and not os.path.exists(source):
            errors.append(
                f"{source}: deleted, taking {len(lost)} resource(s) with it ({', '.join(lost[:3])}"
                f"{', ...' if len(lost) > 3 else ''}); treated as a bad edit. To remove them, "
                "empty the file first, then delete it"
            )
    return tuple(errors)


def endpoint_specs(
    config: GatewayConfig, where: str = "GatewayConfig"
) -> tuple[tuple[EndpointSpec, ...], list[str]]:
    """Endpoint specs of a GatewayConfig, engine resolved (explicit, label, default).

    Returns the specs and a list of precise errors (unknown engine types).
    """
    scraping = config.spec.scraping
    specs: list[EndpointSpec] = []
    errors: list[str] = []
    for index, entry in enumerate(config.spec.endpoints):
        explicit = str(entry.engine) if entry.engine is not None else None
        try:
            engine = scraping.engine_for(entry.labels, explicit)
        except ValueError as exc:
            field_path = (
                f"spec.endpoints[{index}].engine"
                if explicit
                else f"spec.endpoints[{index}].labels[{scraping.engine_label}]"
            )
            errors.append(f"{where}: {field_path}: {exc}")
            continue
        specs.append(
            EndpointSpec(
                name=entry.name,
                address=entry.address,
                port=entry.port,
                labels=MappingProxyType(dict(entry.labels)),
                engine=engine,
            )
        )
    return tuple(specs), errors


def fingerprint(paths: Sequence[Path]) -> Fingerprint:
    """(path, mtime_ns, size, inode) of every file the loader would read; (-1,...) if missing."""
    entries: list[tuple[str, int, int, int]] = []
    for path in paths:
        if path.is_dir():
            files = sorted(
                p
                for p in path.rglob("*")
                if p.suffix in SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
        else:
            files = [path]
        for file in files:
            try:
                st = os.stat(file)
            except OSError:
                entries.append((str(file), -1, -1, -1))
                continue
            if path.is_dir() and not os.path.isfile(file):
                continue
            entries.append((str(file), st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(entries)
