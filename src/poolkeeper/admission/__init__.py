"""Admission: admit or shed a request by its criticality and the pool's saturation.

Runs before scheduling. Critical is never shed; Sheddable is shed (429) once the pool is
saturated; Standard only past a higher overload level. A later flow-control layer will queue
instead of shedding; the controller already returns a decision value it can extend.
"""
