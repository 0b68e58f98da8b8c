"""TEMPORARY stand-ins for sections owned by other modules that have not landed yet."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ObjectMeta(_Loose):
    name: str = ""
    namespace: str = "default"


class SchedulingConfig(_Loose):
    pass


class ScrapingConfig(_Loose):
    pass


class AdmissionConfig(_Loose):
    pass
