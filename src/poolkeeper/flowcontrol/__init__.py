"""Flow control: whether and when a request goes, pure and synchronous (the one gate's core).

Admission (`admission.py`, the `spec.admission` section; `saturation.py`, the pool's
saturation detector; `shedding.py`, admit or shed by criticality when nothing queues) and
queueing (`config.py`, the `spec.flowControl` section; `headroom.py`; `dispatcher.py`, one
pool's queue and what goes next, over `band.py`'s bands, `sharing.py`'s kept places,
`drainrate.py`'s measured rate and `flowitem.py`'s `FlowItem`; the policy seams
`fairness.py`, between flows, today `vtc.py`, and `ordering.py`, within a flow). Reads the
load views of `datastore/` and never imports `scheduling` (where a request goes is its
sibling's question). The async edges, the Director's two gates, are
`requestcontrol/flowgate.py` (queue) and `requestcontrol/shedgate.py` (shed).
"""
