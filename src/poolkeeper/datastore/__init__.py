"""The datastore: pools, models, endpoints and metrics, read as immutable snapshots."""

from poolkeeper.datastore.store import (
    ChangeKind,
    Datastore,
    DatastoreSnapshot,
    EndpointSpec,
    Listener,
)

__all__ = ["ChangeKind", "Datastore", "DatastoreSnapshot", "EndpointSpec", "Listener"]
