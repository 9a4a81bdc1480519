"""Errors that carry a list of problems, each with the path of the value at fault.

Validation and planning report everything wrong at once, so their errors hold every
:class:`Problem` rather than the first; ``str(error)`` is one problem per line.
"""

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec or a plan.

    Args:
        path: where, e.g. ``model.layers[2].units``; empty for the document as a whole.
        message: what is wrong, e.g. ``must be > 0, got -3``.
    """

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message

    def within(self, prefix: str) -> bool:
        """Whether this problem is about the value at ``prefix`` or something inside it.

        Args:
            prefix: a path, e.g. ``model.layers[1]``.

        Returns:
            True for ``model.layers[1]`` itself and e.g. ``model.layers[1].units``.
        """
        return self.path == prefix or self.path.startswith((prefix + ".", prefix + "["))


class FlowError(ValueError):
    """Base of the errors that list problems.

    Args:
        problems: the problems, or one message for a problem without a path.
    """

    def __init__(self, problems: Iterable[Problem] | str) -> None:
        if isinstance(problems, str):
            problems = [Problem("", problems)]
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class SpecError(FlowError):
    """A spec that cannot be decoded or is not valid."""


class PlanError(FlowError):
    """A valid spec that cannot be planned for the devices at hand (e.g. a tensor over budget)."""


def did_you_mean(word: object, choices: Iterable[object]) -> str:
    """The hint that ends a problem's message when ``word`` looks like a misspelt choice.

    One helper for every "unknown name" problem, so all of them read alike.

    Args:
        word: what the spec said; anything but a string gets no hint.
        choices: the names allowed; those that are not strings are left out.

    Returns:
        ``"; did you mean 'x'?"`` for the closest choice, or ``""`` when none is close.
    """
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, [c for c in choices if isinstance(c, str)], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
