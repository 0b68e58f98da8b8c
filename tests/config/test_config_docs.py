"""docs/configuration.md documents every GatewayConfig field, and its tables are current."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from poolkeeper.config.docs import (
    BEGIN_MARKER,
    END_MARKER,
    OWN_SECTIONS,
    field_table,
    main,
    replace_block,
    section_markdown,
)
from poolkeeper.config.gateway import Listeners, RequestHandling
from poolkeeper.requestcontrol.config import TrustedHeader

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@pytest.mark.parametrize(("heading", "model"), OWN_SECTIONS, ids=[h for h, _ in OWN_SECTIONS])
def test_doc_tables_are_current(heading: str, model: type[BaseModel]) -> None:
    text = DOC.read_text(encoding="utf-8")
    assert section_markdown(heading, model) in text, (
        "docs/configuration.md is out of date: run "
        "`.venv/bin/python -m poolkeeper.config.docs docs/configuration.md`"
    )


@pytest.mark.parametrize("model", [Listeners, RequestHandling])
def test_every_field_has_a_description_and_a_row(model: type[BaseModel]) -> None:
    table = field_table(model)
    for name, info in model.model_fields.items():
        assert info.description, f"{model.__name__}.{name} is undocumented"
        assert f"| `{info.alias or name}` |" in table


def test_table_rows_show_type_limits_and_default() -> None:
    table = field_table(RequestHandling)
    row = next(line for line in table.splitlines() if "`maxBodyBytes`" in line)
    assert "integer (>= 1024, <= 1073741824)" in row
    assert "`16777216`" in row
    row = next(line for line in table.splitlines() if "`unknownModelPolicy`" in line)
    assert "`Reject` \\| `PassthroughSheddable`" in row


def test_list_defaults_of_enums_show_their_values() -> None:
    """A list default of enum members read `[<TrustedHeader.INFERENCE_OBJECTIVE: '...'>, ...]`
    (Python's repr) in the reference; it lists the values a user writes in YAML now."""
    row = next(
        line for line in field_table(RequestHandling).splitlines() if "`trustedHeaders`" in line
    )
    default = row.split(" | ")[2]
    assert "<TrustedHeader" not in default
    assert default.startswith("`[x-gateway-inference-objective, ")
    assert default.endswith(", x-llm-d-inference-fairness-id]`")


def test_list_defaults_read_as_yaml_lists() -> None:
    """Review of the audit: a one-item list of enums read like a scalar (no brackets), and a
    list given as `default=` printed Python's repr (`['/a', 'b']`). Both are YAML lists now."""

    class Lists(BaseModel):
        one: list[TrustedHeader] = Field(
            default_factory=lambda: [TrustedHeader.INFERENCE_OBJECTIVE]
        )
        plain: list[str] = ["/a", "b"]
        numbers: tuple[int, ...] = (1, 2)

    defaults = {
        row.split(" | ")[0].strip("| `"): row.split(" | ")[2]
        for row in field_table(Lists).splitlines()[2:]
    }
    assert defaults == {
        "one": "`[x-gateway-inference-objective]`",
        "plain": "`[/a, b]`",
        "numbers": "`[1, 2]`",
    }


def test_regeneration_rewrites_only_the_marked_block(tmp_path: Path) -> None:
    page = tmp_path / "c.md"
    page.write_text(
        f"intro\n{BEGIN_MARKER}\nOLD-TABLE-TEXT\n{END_MARKER}\noutro\n", encoding="utf-8"
    )
    assert main([str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith("intro\n")
    assert text.endswith("\noutro\n")
    assert "OLD-TABLE-TEXT" not in text
    assert "`honorSubsetHint`" in text
    assert replace_block(text, "X") == "intro\nX\noutro\n"
    assert main([str(tmp_path / "c.md"), "extra"]) == 2
    (tmp_path / "plain.md").write_text("no markers", encoding="utf-8")
    assert main([str(tmp_path / "plain.md")]) == 1
