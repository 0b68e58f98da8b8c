"""`CheckedEndpointPickerConfig`: the document as the resource loader sees it (`validate`,
`serve -f`): valid only if it also translates, so a plugin poolkeeper lacks or a bad
reference is reported with the file, like any other invalid object."""

from __future__ import annotations

from typing import Self

from pydantic import PrivateAttr, model_validator

from poolkeeper.api.fielderrors import rule_error
from poolkeeper.config.endpointpicker.document import EndpointPickerConfig
from poolkeeper.config.endpointpicker.translate import (
    InvalidEndpointPickerConfig,
    Translation,
    translate,
)


class CheckedEndpointPickerConfig(EndpointPickerConfig):
    """An EndpointPickerConfig with its translation (Alpha plugins allowed: the command line's
    --allow-experimental-plugins is not known here)."""

    _translation: Translation | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _translates(self) -> Self:
        try:
            self._translation = translate(self, allow_experimental=True)
        except InvalidEndpointPickerConfig as exc:
            raise rule_error(*(("", problem) for problem in exc.problems)) from None
        return self

    @property
    def translation(self) -> Translation:
        assert self._translation is not None
        return self._translation
