"""A file's text into documents, JSON or YAML, with a syntax error as one `LoadError` at its
line and column. YAML is read strictly (`StrictLoader`): timestamps stay strings, duplicate
keys and alias bombs are refused."""

from __future__ import annotations

import json
from typing import Any

import yaml

from poolkeeper.api.load_results import LoadError


def parse_json(text: str, source: str) -> tuple[list[Any], LoadError | None]:
    try:
        return [json.loads(text)], None
    except json.JSONDecodeError as exc:
        return [], LoadError(source, f"invalid JSON: {exc.msg}", line=exc.lineno, column=exc.colno)
    except RecursionError:
        return [], LoadError(source, "invalid JSON: nested too deeply")


def parse_yaml(text: str, source: str) -> tuple[list[Any], LoadError | None]:
    docs: list[Any] = []
    try:
        for doc in yaml.load_all(text, Loader=StrictLoader):
            docs.append(doc)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "malformed document"
        if exc.context and exc.problem:
            started = f" started at line {exc.context_mark.line + 1}" if exc.context_mark else ""
            problem += f" ({exc.context}{started})"
        if mark is None:
            return docs, LoadError(source, f"invalid YAML: {problem}")
        return docs, LoadError(
            source, f"invalid YAML: {problem}", line=mark.line + 1, column=mark.column + 1
        )
    except yaml.YAMLError as exc:
        return docs, LoadError(source, f"invalid YAML: {exc}")
    except RecursionError:
        return docs, LoadError(source, "invalid YAML: nested too deeply")
    return docs, None


MAX_EXPANDED_NODES = 200_000  # a document's nodes with every alias expanded


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Nodes in `node` with aliases expanded (memoised: linear in the composed graph)."""
    known = memo.get(id(node))
    if known is not None:
        return known
    memo[id(node)] = 1  # a cycle counts once (the constructor refuses what it cannot build)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    memo[id(node)] = size
    return size


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that keeps timestamps as strings (like JSON), rejects duplicate keys, and
    refuses documents whose aliases expand past MAX_EXPANDED_NODES (a "billion laughs" bomb
    composes in microseconds but would take hours to validate)."""

    def compose_document(self) -> yaml.Node | None:
        node: yaml.Node | None = super().compose_document()
        if node is not None and _expanded_size(node, {}) > MAX_EXPANDED_NODES:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"document expands to more than {MAX_EXPANDED_NODES} nodes (aliases)",
                node.start_mark,
            )
        return node

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                duplicate = False  # unhashable keys are reported by the base class
            if duplicate:
                first = seen[key].start_mark
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"found duplicate key {key!s} (first defined at line {first.line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)
