"""TEMPORARY stand-ins for sections owned by other modules that have not landed yet."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class SchedulingConfig(_Loose):
    pass


class AdmissionConfig(_Loose):
    pass
