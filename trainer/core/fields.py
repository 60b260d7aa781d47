"""One setting, two ways: the field of `Settings` that declares it (`setting()`: its default, help, bounds and what it
changes) and the row of the table of variables made from that field (`Setting`: its `FT_*` name, what a valid value
looks like, how environs reads it).

settings.py declares every field with `setting()` and builds its table with `rows(Settings)`; the table is what
`load`, the generated docs (settings_doc.py), the MLflow params and the fingerprint read.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from trainer.core.precedence import PREFIX

CHANGES = ("", "data", "training")  # what a setting changes: nothing of the result, the tokenized data, or the training
INT_MAX = 2**31 - 1  # the largest integer setting unless its field says otherwise: every count stays a 32-bit integer downstream


def setting(default: Any, help: str, *, minimum: float | None = None, maximum: int | None = None, changes: str = "", group: str | None = None) -> Any:  # noqa: A002
    """A field of `Settings`: its default and what the README says of it.

    `maximum` applies to integers only (default INT_MAX); floats must be finite (no `nan`, `inf`).

    `changes`: "data" when it changes the checked, tokenized data (and so the result), "training" when it
    changes the computation after that; "" for cadence, paths and speed levers that keep the result.
    `group` starts a new group of the README's table at this field.
    """
    assert changes in CHANGES
    return dataclasses.field(default=default, metadata={"help": help, "minimum": minimum, "maximum": maximum, "changes": changes, "group": group})


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the README's table: a `Settings` field seen as an environment variable."""

    name: str  # the field name, e.g. max_steps
    kind: type | tuple[str, ...]  # int, float, bool, str, or the allowed values
    default: Any
    help: str
    group: str
    minimum: float | None
    changes: str
    maximum: int | None = None  # integers only
    words: tuple[str, ...] = ()  # a number's setting: words it takes instead (`int | Literal["auto"]`: FT_SAVE_STEPS=auto)

    @property
    def env_name(self) -> str:
        return PREFIX + self.name.upper()

    @property
    def allowed(self) -> str:
        """What a valid value looks like, for error messages."""
        if isinstance(self.kind, tuple):
            return "one of " + ", ".join(self.kind)
        floor = f" >= {self.minimum:g}" if self.minimum is not None else ""
        ceiling = f" and <= {self.maximum}" if self.maximum is not None else ""
        plain = {int: f"an integer{floor}{ceiling}", float: f"a finite number{floor}, e.g. {self.default}", bool: "true or false", str: "text"}[self.kind]
        return plain + "".join(f" or {word}" for word in self.words)

    @property
    def type_name(self) -> str:
        if isinstance(self.kind, tuple):
            return " \\| ".join(f"`{c}`" for c in self.kind)
        return " \\| ".join([self.kind.__name__, *(f"`{word}`" for word in self.words)])

    def read(self, env: Any, raw: str | None = None) -> Any:
        """This setting's value from environs' `env` (precedence.reader), its default when unset; a value that does not
        parse or is out of bounds is collected by `env` and reported when it is sealed.  `raw`: the value as set, for
        the words a number's setting takes instead (`auto`)."""
        from marshmallow.validate import OneOf, Range

        key = self.name.upper()
        if isinstance(self.kind, tuple):
            return env.str(key, self.default, validate=OneOf(self.kind, error="not a valid choice"))
        if self.words and raw in self.words:
            return raw
        bounded = self.minimum is not None or self.maximum is not None
        validate = Range(min=self.minimum, max=self.maximum, error="out of range") if bounded else None
        parse = {int: env.int, float: env.float, bool: env.bool, str: env.str}[self.kind]  # env.float refuses nan and inf
        return parse(key, self.default, validate=validate)


def rows(settings_class: type) -> tuple[Setting, ...]:
    """The table of variables: one row per field declared with `setting()`, in order, each in the group last started."""
    hints = typing.get_type_hints(settings_class)
    found, group = [], ""
    for f in dataclasses.fields(settings_class):
        if "help" not in f.metadata:
            continue
        group = f.metadata["group"] or group
        kind = hints[f.name]
        words: tuple[str, ...] = ()
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # a number or words: `int | Literal["auto"]`
            kind, literal = typing.get_args(kind)
            words = typing.get_args(literal)
        kind = typing.get_args(kind) if typing.get_origin(kind) is Literal else kind
        maximum = (f.metadata["maximum"] or INT_MAX) if kind is int else None
        found.append(Setting(f.name, kind, f.default, f.metadata["help"], group, f.metadata["minimum"], f.metadata["changes"], maximum, words))
    return tuple(found)
