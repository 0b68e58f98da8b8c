"""Request control: the Director turns one incoming request into a routing decision.

body -> model -> traffic split -> admission by criticality -> scheduler -> decision.
Transport-independent: the ext_proc server (and any other front end) calls the Director.
"""
