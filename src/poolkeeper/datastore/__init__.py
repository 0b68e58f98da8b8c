"""The datastore: pools, models, endpoints and metrics, read as immutable snapshots."""

from poolkeeper.datastore.snapshot import DatastoreSnapshot, EndpointSpec
from poolkeeper.datastore.store import ChangeKind, Datastore, Listener

__all__ = ["ChangeKind", "Datastore", "DatastoreSnapshot", "EndpointSpec", "Listener"]
