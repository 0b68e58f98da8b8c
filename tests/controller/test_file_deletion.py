"""Round 2, finding 6: deleting a watched resource file emptied the model set. A deletion that
takes resources with it is now a bad edit (the last good state stays, an error names the
file); the operator confirms a removal by emptying the file first, and moving resources to
another file before deleting the old one is no removal at all."""

from __future__ import annotations

from pathlib import Path

from poolkeeper.controller.files import FileResourceSource
from poolkeeper.datastore import Datastore
from tests.controller.test_file_source import GATEWAY, MODELS, NOW, POOL, write


def _source(tmp_path: Path) -> tuple[FileResourceSource, Datastore]:
    write(tmp_path / "pool.yaml", POOL)
    write(tmp_path / "models.yaml", MODELS)
    write(tmp_path / "gateway.yaml", GATEWAY)
    store = Datastore()
    source = FileResourceSource([tmp_path], store, interval=0.05, now=lambda: NOW)
    assert source.reload().applied
    return source, store


def _models(store: Datastore) -> int:
    snapshot = store.snapshot()
    return sum(len(snapshot.models(key)) for key in snapshot.pool_keys())


def test_a_deleted_models_file_is_a_bad_edit(tmp_path: Path) -> None:
    source, store = _source(tmp_path)
    assert _models(store) == 1  # two InferenceModels, one client-facing name
    (tmp_path / "models.yaml").unlink()
    outcome = source.poll()
    assert outcome is not None
    assert not outcome.applied
    assert _models(store) == 1  # the last good state stays
    (error,) = outcome.errors
    assert "models.yaml: deleted, taking 2 resource(s)" in error
    assert "empty the file first" in error
    # The file comes back: applied again, nothing lost.
    write(tmp_path / "models.yaml", MODELS)
    again = source.poll()
    assert again is not None
    assert again.applied


def test_emptying_then_deleting_removes_the_resources(tmp_path: Path) -> None:
    source, store = _source(tmp_path)
    write(tmp_path / "models.yaml", "")
    emptied = source.poll()
    assert emptied is not None
    assert emptied.applied
    assert _models(store) == 0
    (tmp_path / "models.yaml").unlink()
    deleted = source.poll()
    assert deleted is not None
    assert deleted.applied


def test_moving_resources_to_another_file_is_no_removal(tmp_path: Path) -> None:
    source, store = _source(tmp_path)
    write(tmp_path / "models-v2.yaml", MODELS)
    (tmp_path / "models.yaml").unlink()
    outcome = source.poll()
    assert outcome is not None
    assert outcome.applied, outcome.errors
    assert _models(store) == 1
