"""Validation of a spec: pure, and it returns every problem, each with its path.

A spec may come from a file or be built in Python with any object in any field, so validation
first checks each value against its field's annotation (types, literals, tuple lengths, finite
numbers), then each record's own rules (:mod:`flow.spec_rules`: ranges, fields that must agree, and
what spans records: layer shapes, the loss against the last layer, the pipeline's graph). This
module is the walk over the spec and the type checks; a rule only looks at fields that passed the
checks before it, so one mistake is reported once and never crashes a later rule. The data's
problems against the model are :func:`flow.data_plan.data_problems`; the summary for people is
:func:`flow.summary.summarize`.
"""

import math
from dataclasses import fields, is_dataclass
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

from flow.errors import Problem, SpecError, did_you_mean
from flow.spec import Spec, file_key
from flow.spec_model import LayerRecord
from flow.spec_rules import RULES, Rule, join, layer_links, show


def alternatives(annotation: Any) -> tuple[Any, ...]:
    """The alternatives a field annotation allows: the members of a union, else the annotation.

    Args:
        annotation: a field's type, e.g. ``int | None`` or ``tuple[Layer, ...]``.

    Returns:
        The alternatives, in order, with None as ``NoneType``.
    """
    if isinstance(annotation, UnionType) or get_origin(annotation) is Union:
        return tuple(a for member in get_args(annotation) for a in alternatives(member))
    return (annotation,)


def validate(spec: Spec) -> list[Problem]:
    """Every problem with a spec.

    Args:
        spec: the spec, from a file or built in Python.

    Returns:
        The problems, in the order of the spec's fields; empty when the spec is valid.
    """
    walk = _Walk()
    walk.check(spec, Spec, "")
    return walk.problems


def check(spec: Spec) -> None:
    """Raise unless a spec is valid.

    Args:
        spec: the spec.

    Raises:
        SpecError: listing every problem, one per line.
    """
    problems = validate(spec)
    if problems:
        raise SpecError(problems)


def _describe(annotation: Any) -> str:
    """An annotation in words, for 'must be ...' messages."""
    options = alternatives(annotation)
    records = [o.__name__ for o in options if is_dataclass(o)]
    words = []
    if records:
        words.append(f"a {records[0]}" if len(records) == 1 else "one of " + ", ".join(records))
    for option in options:
        if option is NoneType:
            words.append("None")
        elif get_origin(option) is Literal:
            words.append("one of " + ", ".join(repr(a) for a in get_args(option)))
        elif get_origin(option) is tuple:
            args = get_args(option)
            words.append("a tuple" if args[-1] is Ellipsis else f"a tuple of {len(args)}")
        elif not is_dataclass(option):
            names = {int: "an int", float: "a number", str: "a string", bool: "a bool"}
            words.append(names.get(option, getattr(option, "described", "an array")))
    return " or ".join(words)


def _hint(value: Any, annotation: Any) -> str:
    """'; did you mean ...?' for a string close to one of the literals allowed."""
    allowed = [a for o in alternatives(annotation) if get_origin(o) is Literal for a in get_args(o)]
    return did_you_mean(value, allowed)


def _matches(value: Any, option: Any) -> bool:
    """Whether a value has the shape of one alternative (its contents are checked afterwards)."""
    if option is NoneType:
        return value is None
    if get_origin(option) is Literal:
        return any(type(value) is type(a) and value == a for a in get_args(option))
    if get_origin(option) is tuple:
        return isinstance(value, tuple)
    if option is float:  # an int is a fine float; bool is an int to Python but never a number here
        return isinstance(value, int | float) and not isinstance(value, bool)
    if option is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, option)


class _Walk:
    """Walks a spec against its annotations, collecting problems."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, path: str, message: str) -> None:
        self.problems.append(Problem(path, message))

    def bad(self, path: str) -> bool:
        return any(p.within(path) for p in self.problems)

    def check(self, value: Any, annotation: Any, path: str) -> bool:
        """Check a value and everything inside it; True when that added no problem."""
        start = len(self.problems)
        option = next((o for o in alternatives(annotation) if _matches(value, o)), None)
        if option is None:
            self.add(path, f"must be {_describe(annotation)}, got {show(value)}{_hint(value, annotation)}")
        elif isinstance(value, float) and not math.isfinite(value):
            self.add(path, f"must be finite, got {value}")
        elif isinstance(value, int) and not -(2**63) <= value < 2**63:
            self.add(path, f"must fit in 64 bits (msgpack's limit), got {show(value)}")
        elif get_origin(option) is tuple:
            args = get_args(option)
            if args[-1] is Ellipsis:
                for i, item in enumerate(value):
                    self.check(item, args[0], f"{path}[{i}]")
            elif len(value) != len(args):
                self.add(path, f"must have {len(args)} items, got {len(value)}")
            else:
                for i, (item, arg) in enumerate(zip(value, args, strict=True)):
                    self.check(item, arg, f"{path}[{i}]")
        elif is_dataclass(option):
            self.record(value, path)
        return len(self.problems) == start

    def record(self, obj: Any, path: str) -> None:
        cls = type(obj)
        clean = {
            f.name
            for f in fields(obj)
            if self.check(getattr(obj, f.name), f.type, join(path, file_key(cls, f.name)))
        }
        rule = RULES.get(cls)
        if rule is not None:
            rule(Rule(self, obj, path, clean))
        if isinstance(obj, LayerRecord):
            layer_links(Rule(self, obj, path, clean))

