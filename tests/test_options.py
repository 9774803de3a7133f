"""``distbelief.options``: the options dataclasses are the one definition the front doors' keywords, defaults
and docs follow (each against the other here, so they cannot drift), and the generic checks."""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from distbelief import downpour, sandblaster
from distbelief.errors import InvalidOptionError
from distbelief.options import check_fields, defaults, option, option_names

#: The front doors' keywords that are not options: the data's company and the run's plumbing.
NOT_OPTIONS = {"x0", "client", "store", "callback", "eval_data"}
_SO = sandblaster.SandblasterOptions
FRONT_DOORS: list[tuple[Callable[..., Any], type]] = [
    (sandblaster.minimize, sandblaster.SandblasterOptions),
    (downpour.train, downpour.DownpourOptions),
]


def _keywords(fn: Callable[..., Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _documented(fn: Callable[..., Any]) -> list[str]:
    """The names of the numpydoc ``Parameters`` section of ``fn`` (``a, b : int`` names two)."""
    doc = inspect.getdoc(fn) or ""
    section = re.split(r"\n(?:Returns|Raises|Examples)\n-", doc.split("Parameters\n----------\n", 1)[1])[0]
    names = [m.group(1) for m in re.finditer(r"^(\w+(?:, \w+)*) :", section, re.MULTILINE)]
    return [name for group in names for name in group.split(", ")]


@pytest.mark.parametrize(("front_door", "options"), FRONT_DOORS)
def test_the_front_doors_keywords_and_defaults_are_the_options(
    front_door: Callable[..., Any], options: type
) -> None:
    keywords = _keywords(front_door)
    assert set(keywords) - NOT_OPTIONS == set(option_names(options))
    assert {name: keywords[name] for name in option_names(options)} == defaults(options)


class _Built(Exception):
    pass


@pytest.mark.parametrize(("front_door", "options"), FRONT_DOORS)
def test_every_option_a_front_door_is_given_reaches_its_options_object(
    monkeypatch: pytest.MonkeyPatch, front_door: Callable[..., Any], options: type
) -> None:
    # A stand-in for the options class records what the front door built it with: a keyword the front
    # door forgot to pass would arrive as the class's default, not as what the caller gave.
    built: dict[str, Any] = {}

    class StandIn(options):  # type: ignore[misc]
        def __post_init__(self) -> None:  # records the fields as given, checks nothing
            built.update({name: getattr(self, name) for name in option_names(options)})
            raise _Built

    # Patched where the options object is built: the front door's module (Sandblaster) or the options'
    # own, whose options_from builds it from train()'s arguments (Downpour).
    for module in {sys.modules[front_door.__module__], sys.modules[options.__module__]}:
        monkeypatch.setattr(module, options.__name__, StandIn)
    # Distinct strings (the stand-in checks nothing); train() sends partitions > 1 elsewhere (its own test).
    given = {name: f"<{name}>" for name in option_names(options) if name != "partitions" or options is _SO}
    with pytest.raises(_Built):
        front_door(None, None, **given)
    assert {name: built.get(name) for name in given} == given


@pytest.mark.parametrize(("front_door", "options"), FRONT_DOORS)
def test_every_keyword_is_documented_once_and_nothing_else(
    front_door: Callable[..., Any], options: type
) -> None:
    documented = _documented(front_door)
    assert sorted(documented) == sorted(set(documented))
    assert set(documented) == {"model", "data", *_keywords(front_door)}


@pytest.mark.parametrize(("front_door", "options"), FRONT_DOORS)
def test_an_unknown_keyword_names_the_closest_option(front_door: Callable[..., Any], options: type) -> None:
    # Refused before anything runs (model and data are not even looked at).
    with pytest.raises(InvalidOptionError, match=r"unknown option 'l22' .*; did you mean 'l2'\?"):
        front_door(None, None, l22=1.0)
    with pytest.raises(InvalidOptionError, match=r"unknown option 'learning_rat' .*; valid options: .*seed"):
        front_door(None, None, learning_rat=0.1)


@pytest.mark.parametrize("name", ["maxls", "in_flight", "step", "restart_every"])
def test_the_options_that_were_not_settable_are_keywords_that_are_checked(name: str) -> None:
    with pytest.raises(InvalidOptionError, match=rf"option {name}=0 is invalid"):
        sandblaster.minimize(None, None, **{name: 0})  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class _Example:
    count: int = option(1, ge=1, le=10)
    rate: float | None = option(None, gt=0)
    kind: Literal["a", "b"] = option("a")
    flag: bool = option(False)
    pairs: tuple[int, ...] = option(())  # not a type the generic check knows: left to the class
    internal: int = -1

    def __post_init__(self) -> None:
        check_fields(self)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"count": 0}, "count=0 is invalid: expected an int >= 1 and <= 10"),
        ({"count": 11}, "count=11 is invalid"),
        ({"count": 2.0}, "count=2.0 is invalid"),
        ({"count": True}, "count=True is invalid"),
        ({"rate": 0.0}, r"rate=0.0 is invalid: expected None or a finite number > 0"),
        ({"rate": float("nan")}, "rate=nan is invalid"),
        ({"rate": "1"}, "rate='1' is invalid"),
        ({"kind": "c"}, "kind='c' is invalid: expected 'a' or 'b'"),
        ({"flag": 1}, "flag=1 is invalid: expected True or False"),
    ],
)
def test_the_generic_checks_refuse_bad_values_naming_them(given: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        _Example(**given)


def test_the_generic_checks_take_good_values() -> None:
    import numpy as np

    assert _Example(count=np.int64(10), rate=2, kind="b", flag=True, pairs=("x",)).count == 10  # type: ignore[arg-type]
    assert option_names(_Example) == ("count", "rate", "kind", "flag", "pairs")
    assert defaults(_Example) == {"count": 1, "rate": None, "kind": "a", "flag": False, "pairs": ()}
