"""`FileResourceSource`: YAML/JSON files → the datastore, reloaded on change without a restart.

The file implementation of the `ResourceSource` seam (`controller/source.py`). It loads the
given files and directories with the API loader (`poolkeeper.api.load`), applies the
InferencePools, InferenceModels, InferenceObjectives, InferenceModelRewrites and the standalone
endpoints of the GatewayConfig document (`spec.endpoints`) in one datastore write, yields that
GatewayConfig (the default one when the files have none; at most one is allowed), and
computes every InferenceModel's `Accepted` status from the datastore's model index, logging
changes. `load_files` is the one reader of
resource files: `serve`, `envoy-config` and hot reload all go through it.

Hot reload: `run()` polls the files' (mtime, size, inode) every `interval` seconds and reloads
when anything changed, including files added to or removed from a directory. A load with any
error (bad YAML, invalid object, two GatewayConfigs, an unknown engine type) is not applied:
the last good state stays in force, each error is logged once as `file[:doc]: Kind/ns/name:
field.path: message`, and `last_errors` keeps them until a good load. A deleted file is such
an error too when resources it held are gone with it (reliability round 2, finding 6: deleting
the models file emptied the model set): to remove a file's resources, the operator empties the
file (or deletes its documents) first, then deletes it; moving resources to another file and
deleting the old one is fine. File reading and
validation run in a worker thread; datastore writes happen on the event loop, because listeners
(the scraper manager) start tasks.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType

from pydantic import ValidationError

from poolkeeper.api.fielderrors import from_pydantic
from poolkeeper.api.load import SUFFIXES
from poolkeeper.api.load_results import LoadedResource, LoadResult
from poolkeeper.api.model import CONDITION_ACCEPTED, InferenceModel, InferenceModelStatus
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.api.status import Verdict, compute_model_statuses
from poolkeeper.config.endpointpicker.checked import CheckedEndpointPickerConfig
from poolkeeper.config.endpointpicker.replicasync import key_context
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.config.load import load_paths
from poolkeeper.controller.source import SourceFactory
from poolkeeper.datastore.models import ModelResource
from poolkeeper.datastore.store import Datastore, EndpointSpec
from poolkeeper.errors import ConfigError

__all__ = [
    "FileResourceSource",
    "LoadedFiles",
    "ReloadOutcome",
    "endpoint_specs",
    "file_source",
    "load_files",
]

log = logging.getLogger(__name__)

Fingerprint = tuple[tuple[str, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    """What one load attempt did."""

    applied: bool
    errors: tuple[str, ...] = ()
    notices: tuple[str, ...] = ()
    pools: int = 0
    models: int = 0
    endpoints: int = 0


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


def file_source(paths: Sequence[str | Path], *, interval: float = 1.0) -> SourceFactory:
    """The factory `ServeOptions.source` takes for resources read from `paths`."""
    return lambda datastore: FileResourceSource(paths, datastore, interval=interval)


class FileResourceSource:
    """Feeds a datastore from files and keeps it in step with them (a `ResourceSource`)."""

    def __init__(
        self,
        paths: Sequence[str | Path],
        datastore: Datastore,
        *,
        interval: float = 1.0,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        source: str = "files",
    ) -> None:
        self.paths = tuple(Path(p) for p in paths)
        self.interval = interval
        self._datastore = datastore
        self._now = now
        self._source = source
        self._fingerprint: Fingerprint | None = None
        self._statuses: Mapping[str, InferenceModelStatus] = MappingProxyType({})
        self._gateway_config: GatewayConfig | None = None  # set by the first good load
        self._errors: tuple[str, ...] = ()
        self._held: Mapping[str, frozenset[str]] = MappingProxyType({})  # of the last good load
        self.loads = 0  # successful loads applied

    # --- queries -----------------------------------------------------------------------------

    def describe(self) -> str:
        return "files " + ", ".join(map(str, self.paths))

    def statuses(self) -> Mapping[str, InferenceModelStatus]:
        """Computed status of every loaded InferenceModel, by `namespace/name`."""
        return self._statuses

    def healthy(self) -> bool:
        """Always: a bad reload keeps the last good state in force."""
        return True

    def stale_s(self) -> float:
        """Never stale: the files read are the state (a bad reload is reported on its own)."""
        return 0.0

    @property
    def gateway_config(self) -> GatewayConfig | None:
        """The GatewayConfig of the last good load (the default one if the files have none);
        None before the first good load."""
        return self._gateway_config

    @property
    def last_errors(self) -> tuple[str, ...]:
        """Errors of the last load attempt (empty once a load succeeded)."""
        return self._errors

    # --- loading -----------------------------------------------------------------------------

    async def start(self) -> GatewayConfig:
        """The first load: applied, or ConfigError listing every problem (nothing applied)."""
        if not self.paths:
            raise ConfigError("no files given: pass -f PATH (files or directories of YAML)")
        self._fingerprint = await asyncio.to_thread(fingerprint, self.paths)
        loaded = await asyncio.to_thread(self._load)
        if not loaded.pools and not loaded.errors:
            loaded = replace(loaded, errors=("no InferencePool found in the given files",))
        outcome = self._apply(loaded)
        if not outcome.applied or self._gateway_config is None:
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(outcome.errors))
        return self._gateway_config

    def reload(self) -> ReloadOutcome:
        """Load now and apply if valid (blocking; for startup and tests)."""
        self._fingerprint = fingerprint(self.paths)
        return self._apply(self._load())

    def poll(self) -> ReloadOutcome | None:
        """Reload if the files changed since the last attempt (blocking); None if unchanged."""
        current = fingerprint(self.paths)
        if current == self._fingerprint:
            return None
        self._fingerprint = current
        return self._apply(self._load())

    async def run(self) -> None:
        """Poll for changes every `interval` seconds until cancelled (load first if never)."""
        if self._fingerprint is None:
            self._fingerprint = await asyncio.to_thread(fingerprint, self.paths)
            self._apply(await asyncio.to_thread(self._load))
        while True:
            await asyncio.sleep(self.interval)
            try:
                current = await asyncio.to_thread(fingerprint, self.paths)
                if current == self._fingerprint:
                    continue
                self._fingerprint = current
                log.info("resource files changed; reloading %s", ", ".join(map(str, self.paths)))
                self._apply(await asyncio.to_thread(self._load))
            except Exception:  # never let a surprise end hot reload
                log.exception("reloading %s failed", ", ".join(map(str, self.paths)))

    def _load(self) -> LoadedFiles:
        loaded = load_files(self.paths)
        deleted = deleted_file_errors(self._held, loaded) if self.loads else ()
        return replace(loaded, errors=(*loaded.errors, *deleted)) if deleted else loaded

    def _apply(self, loaded: LoadedFiles) -> ReloadOutcome:
        for notice in loaded.notices:
            log.info("%s", notice)
        if loaded.errors:
            self._errors = loaded.errors
            kept = "keeping the last good state" if self.loads else "nothing loaded"
            for error in loaded.errors:
                log.error("%s", error)
            log.error("resource files have %d error(s); %s", len(loaded.errors), kept)
            return ReloadOutcome(applied=False, errors=loaded.errors, notices=loaded.notices)
        self._errors = ()
        self._held = loaded.held
        self._gateway_config = loaded.gateway_config
        snapshot = self._datastore.set_all(
            loaded.pools, (*loaded.models, *loaded.policies), loaded.specs, source=self._source
        )
        self._update_statuses(loaded.models, snapshot.model_index.verdicts)
        self.loads += 1
        log.info(
            "loaded %d pool(s), %d model(s), %d endpoint(s) from files",
            len(loaded.pools),
            len(loaded.models),
            len(loaded.specs),
        )
        return ReloadOutcome(
            applied=True,
            notices=loaded.notices,
            pools=len(loaded.pools),
            models=len(loaded.models),
            endpoints=len(loaded.specs),
        )

    def _update_statuses(
        self, models: Sequence[InferenceModel], verdicts: Mapping[str, Verdict]
    ) -> None:
        previous = self._statuses
        statuses = compute_model_statuses(models, verdicts, now=self._now(), previous=previous)
        for key, status in statuses.items():
            new = status.condition(CONDITION_ACCEPTED)
            old_status = previous.get(key)
            old = old_status.condition(CONDITION_ACCEPTED) if old_status is not None else None
            if new is not None and (
                old is None
                or (old.status, old.reason, old.message) != (new.status, new.reason, new.message)
            ):
                log_level = logging.INFO if new.status == "True" else logging.WARNING
                log.log(
                    log_level,
                    "InferenceModel %s: Accepted=%s (%s): %s",
                    key,
                    new.status,
                    new.reason,
                    new.message,
                )
        for key in previous.keys() - statuses.keys():
            log.info("InferenceModel %s: removed", key)
        self._statuses = MappingProxyType(statuses)


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
