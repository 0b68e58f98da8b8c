"""`CamelModel`: the one pydantic base of the camelCase documents poolkeeper reads.

The API objects (`api.meta.ApiModel`), the GatewayConfig sections and the plugin parameters all
share its rules: keys are camelCase (the snake_case field names are accepted too) and unknown
keys are errors, so a typo fails the load instead of silently keeping a default. Settings are
frozen (read once at startup, shared by every component); the API objects opt out
(`frozen=False`), like the Kubernetes objects they mirror. A subclass adds what only it needs
as class arguments:

    class ScrapingConfig(CamelModel, use_attribute_docstrings=True): ...

The bottom layer: imports nothing from poolkeeper.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class CamelModel(BaseModel):
    """camelCase keys (snake_case accepted), unknown keys rejected, frozen unless a subclass
    says `frozen=False`."""

    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True
    )


Port = Annotated[int, Field(ge=1, le=65535)]
"""A TCP port number (1..65535)."""
