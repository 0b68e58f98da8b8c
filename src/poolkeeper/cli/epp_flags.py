"""The command line of llm-d-router's EPP (v0.10), parsed the way its Go binary parses it.

Upstream parses with spf13/pflag, so this module follows pflag's rules, not argparse's:

- `--name=value` and `--name value`; a boolean takes `--name` or `--name=false`, and
  `--name value` does not consume the next argument (but see the GIE chart form below);
- an unknown flag is fatal; a flag given twice keeps the last value (an int list appends);
- `-v N`, `-v=N`, `-vN` (the one shorthand); `--` ends the flags; other arguments are ignored.

Older generations are tolerated because charts in the field still render them:

- GIE v0.3-v0.5 flags in camelCase with one or two dashes (`-poolName x`, `--grpcPort=9002`);
- the old `epplib` chart's `--key "value"` pairs, booleans included (`--secure-serving "false"`
  would silently leave pflag's value at true and drop "false"; here it means what it says,
  with a warning), and values wrapped in literal quotes (`--x="a:b"` as one argument);
- flags upstream removed (`--model-server-metrics-*`, `--grpc-enable-compression`, GIE's
  `-destinationEndpointHintKey`...): accepted with a warning, no effect.

The five deprecated metric flags are rejected when set, with upstream's message. `parse_epp_args`
returns `EppOptions` (every value, which flags were given, warnings) or raises `FlagError`
(both `cli/epp_options.py`, with upstream's validation); the flags: `cli/epp_flag_table.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from poolkeeper.cli.epp_flag_table import (
    BY_NAME,
    CAMEL_CASE,
    FLAGS,
    REMOVED,
    REMOVED_WHERE,
    Flag,
    Kind,
)
from poolkeeper.cli.epp_options import EppOptions, FlagError, validate_options
from poolkeeper.config.endpointpicker.values import (
    parse_bool,
    parse_duration,
    parse_int,
    parse_int_list,
)


def _unquote(value: str) -> str:
    """`"x"` -> `x`: the old chart rendered literal quotes into some values."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


@dataclass(slots=True)
class _Parse:
    values: dict[str, object] = field(default_factory=lambda: {f.name: f.default for f in FLAGS})
    given: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def set(self, flag: Flag, raw: str, shown: str) -> None:
        value = _unquote(raw)
        try:
            converted = _convert(flag, value)
        except ValueError as exc:
            raise FlagError(f'invalid argument "{value}" for "{shown}" flag: {exc}') from None
        if flag.kind is Kind.INTS and flag.name in self.given:
            previous = self.values[flag.name]
            assert isinstance(previous, tuple)
            assert isinstance(converted, tuple)
            converted = previous + converted
        self.values[flag.name] = converted
        self.given.add(flag.name)


def _convert(flag: Flag, value: str) -> object:
    if flag.kind is Kind.BOOL:
        return parse_bool(value)
    if flag.kind is Kind.INT:
        return parse_int(value)
    if flag.kind is Kind.PORT:
        number = parse_int(value)
        if not 0 <= number <= 65535:
            raise ValueError("value out of range")
        return number
    if flag.kind is Kind.DURATION:
        return parse_duration(value)
    if flag.kind is Kind.INTS:
        return parse_int_list(value)
    if flag.kind is Kind.STRINGS:
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if flag.choices and value not in flag.choices:
        allowed = ", ".join(c for c in flag.choices if c)
        raise ValueError(f"must be one of {allowed}")
    return value


def _lookup(name: str, dashes: str) -> tuple[Flag | None, Kind | None]:
    """(flag, None) for a current flag; (None, kind) for a removed one; (None, None) unknown."""
    if name in BY_NAME and (dashes == "--" or name == "v" or "-" in name):
        return BY_NAME[name], None
    if name in CAMEL_CASE:
        return BY_NAME[CAMEL_CASE[name]], None
    if name in REMOVED:
        return None, REMOVED[name]
    if dashes == "-" and name in BY_NAME:  # Go's flag package: -name works like --name
        return BY_NAME[name], None
    return None, None


def parse_epp_args(argv: Sequence[str]) -> EppOptions:
    """Parse and validate an EPP command line (raises FlagError with upstream's wording)."""
    state = _Parse()
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            state.ignored.extend(args[i:])
            break
        if not arg.startswith("-") or arg == "-":
            state.ignored.append(arg)
            continue
        dashes = "--" if arg.startswith("--") else "-"
        body = arg[len(dashes) :]
        name, has_value, raw = body.partition("=")
        if dashes == "-" and name.startswith("v") and name[1:].isdigit():  # -v3
            name, has_value, raw = "v", "=", name[1:]
        flag, removed = _lookup(name, dashes)
        if flag is None and removed is None:
            if dashes == "-" and len(name) > 1 and name not in CAMEL_CASE:
                raise FlagError(f"unknown shorthand flag: {name[0]!r} in {arg}")
            raise FlagError(f"unknown flag: {dashes}{name}")
        kind = flag.kind if flag is not None else removed
        assert kind is not None
        shown = f"{dashes}{name}"
        if not has_value:
            nxt = args[i] if i < len(args) else None
            if kind is Kind.BOOL:
                raw = "true"
                if nxt is not None and _unquote(nxt).lower() in ("true", "false"):
                    # The old chart's `--flag "false"`: pflag would drop the value.
                    raw = _unquote(nxt)
                    i += 1
                    state.warnings.append(
                        f'{shown} "{raw}": read as {shown}={raw} (pflag would ignore the '
                        "value; write it as one argument)"
                    )
            elif nxt is None:
                raise FlagError(f"flag needs an argument: {shown}")
            else:
                raw = nxt
                i += 1
        if flag is None:
            place = REMOVED_WHERE[0] if "etrics" in name else REMOVED_WHERE[1]
            state.warnings.append(f"{shown} was removed upstream and is ignored; use {place}")
            continue
        if name != flag.name:
            state.warnings.append(f"{shown} is the GIE v0.x spelling of --{flag.name}")
        state.set(flag, raw, shown)
    options = EppOptions(
        values=MappingProxyType(dict(state.values)),
        given=frozenset(state.given),
        warnings=tuple(state.warnings),
        ignored_args=tuple(state.ignored),
    )
    validate_options(options)
    return options
