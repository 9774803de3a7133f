"""One definition of an algorithm's options: a frozen dataclass whose fields carry their bounds and doc.

Each option of :class:`sandblaster.SandblasterOptions` and :class:`downpour.DownpourOptions` is declared
once, with :func:`option`: its type and default (the dataclass field), its bounds or choices (the type's
``Literal``), a one-line description, and whether the REST service takes it. From that one declaration
come the checks on construction (:func:`check_fields`; rules between fields stay code in each
``__post_init__``), the service's pydantic models (:func:`rest_model`: ``SandblasterJobOptions``,
``DownpourJobOptions``), the front doors' defaults, and the refusal of an unknown keyword
(:func:`refuse_unknown`), which names the closest valid one.

Examples
--------
>>> from dataclasses import dataclass
>>> @dataclass(frozen=True, kw_only=True)
... class Opts:
...     steps: int = option(10, ge=1)
...     def __post_init__(self) -> None:
...         check_fields(self)
>>> Opts(steps=0)
Traceback (most recent call last):
...
distbelief.errors.InvalidOptionError: option steps=0 is invalid: expected an int >= 1
>>> option_names(Opts), defaults(Opts)
(('steps',), {'steps': 10})
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import numbers
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, TypeVar

from distbelief.errors import InvalidOptionError

__all__ = [
    "PARTITIONS_DOC",
    "REST_MAX_ACTORS",
    "REST_MAX_ITER",
    "OptionSpec",
    "check_fields",
    "check_option",
    "defaults",
    "option",
    "option_names",
    "options_of",
    "refuse_unknown",
    "rest_model",
    "worker_tuple",
]

#: More replicas, shards or partitions than this in a REST job is a typo, not a plan: each is a Dask actor.
REST_MAX_ACTORS = 64
#: The REST service's cap on iteration and evaluation counts (the library takes any).
REST_MAX_ITER = 1_000_000
#: The REST description of both algorithms' ``partitions``.
PARTITIONS_DOC = (
    "Model parallelism (paper, section 3): split every replica into this many partition actors, each on its "
    "own worker with its own parameter shards (kinds mlp, locally_connected, locally_connected_2d; at most "
    "the model's narrowest layer, or shortest map). 1 (the default) keeps one process per replica."
)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class OptionSpec:
    """What :func:`option` records in a field's metadata (``field.metadata["option"]``).

    ``ge``, ``gt`` and ``le`` bind the library and the service; ``rest_le`` is the service's tighter
    upper bound against absurd requests (a billion replicas); ``doc`` is the service's description (the
    front door's docstring explains every option at length). ``expected`` replaces the generated "expected
    ..." of the error message; ``check=False`` leaves the field to its class's ``__post_init__`` (types
    the generic check does not know, such as tuples of ranges).
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    rest: bool = False
    rest_le: float | None = None
    doc: str = ""
    expected: str | None = None
    check: bool = True


def option(
    default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None, **spec: Any
) -> Any:
    """A dataclass field that is an option: its default (or ``factory``) and its :class:`OptionSpec`.

    Examples
    --------
    >>> option(1, ge=0).metadata["option"].ge
    0
    """
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"option": OptionSpec(**spec)})
    return dataclasses.field(default=default, metadata={"option": OptionSpec(**spec)})


def _options(cls: Any) -> list[tuple[dataclasses.Field[Any], OptionSpec]]:
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def option_names(cls: Any) -> tuple[str, ...]:
    """The options of ``cls``, in declaration order (fields without :func:`option` are not options)."""
    return tuple(f.name for f, _ in _options(cls))


def defaults(cls: Any) -> dict[str, Any]:
    """Every option of ``cls`` with its default."""
    out = {}
    for f, _ in _options(cls):
        factory = f.default_factory
        out[f.name] = factory() if factory is not dataclasses.MISSING else f.default
    return out


def options_of(cls: Callable[..., R], given: Mapping[str, Any], **extra: Any) -> R:
    """``cls`` built from the entries of ``given`` that are its options (a front door's ``locals()``).

    Examples
    --------
    >>> from distbelief.sandblaster import SandblasterOptions
    >>> options_of(SandblasterOptions, {"maxiter": 5, "client": None}).maxiter
    5
    """
    return cls(**{name: given[name] for name in option_names(cls) if name in given}, **extra)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    # Resolved once per class: the annotations are strings (``from __future__ import annotations``).
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _split_none(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(hint, False)``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else typing.Union[rest]), True  # noqa: UP007
    return hint, False


def _bounds(spec: OptionSpec) -> str:
    parts = [f"{op} {v:g}" for op, v in ((">=", spec.ge), (">", spec.gt), ("<=", spec.le)) if v is not None]
    return (" " + " and ".join(parts)) if parts else ""


def _expected(base: Any, optional: bool, spec: OptionSpec) -> str:
    if typing.get_origin(base) is Literal:
        words = [repr(v) for v in typing.get_args(base)]
        text = ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]
    elif base is bool:
        text = "True or False"
    elif base is int:
        text = "an int" + _bounds(spec)
    else:
        text = "a finite number" + _bounds(spec)
    return f"None or {text}" if optional else text


def _valid(value: Any, base: Any, spec: OptionSpec) -> bool:
    if typing.get_origin(base) is Literal:
        return isinstance(value, str | int) and value in typing.get_args(base)
    if base is bool:
        return isinstance(value, bool)
    # numbers.Integral / Real: numpy's scalars too (an estimator's np.int64 from a grid search).
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    if base is int and not isinstance(value, numbers.Integral):
        return False
    value = float(value)
    if not math.isfinite(value):
        return False
    return not (
        (spec.ge is not None and value < spec.ge)
        or (spec.gt is not None and value <= spec.gt)
        or (spec.le is not None and value > spec.le)
    )


def check_fields(opts: Any) -> None:
    """Check every option of ``opts`` against its type and bounds; the first bad one raises, naming it.

    Handles ``bool``, ``int``, ``float`` (finite), ``Literal[...]`` and those ``| None``; a field of
    another type (or ``check=False``) is its class's own ``__post_init__``'s to check.

    Raises
    ------
    distbelief.errors.InvalidOptionError
        ``option NAME=VALUE is invalid: expected ...``.
    """
    hints = _hints(type(opts))
    for f, spec in _options(opts):
        base, optional = _split_none(hints[f.name])
        if not spec.check or not (base in (bool, int, float) or typing.get_origin(base) is Literal):
            continue
        value = getattr(opts, f.name)
        if (value is None and optional) or _valid(value, base, spec):
            continue
        expected = spec.expected or _expected(base, optional, spec)
        raise InvalidOptionError(f"option {f.name}={value!r} is invalid: expected {expected}")


def check_option(ok: bool, name: str, value: object, expected: str) -> None:
    """Unless ``ok``: ``InvalidOptionError("option NAME=VALUE is invalid: expected EXPECTED")``."""
    if not ok:
        raise InvalidOptionError(f"option {name}={value!r} is invalid: expected {expected}")


def refuse_unknown(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` refusing an unknown keyword with an error naming the closest valid one (difflib), or all of
    them, rather than Python's bare ``TypeError``.

    The signature stays ``fn``'s (``inspect.signature`` follows ``__wrapped__``), so IDEs and mypy
    still see every option with its type.

    Examples
    --------
    >>> @refuse_unknown
    ... def run(*, maxiter: int = 1) -> int:
    ...     return maxiter
    >>> run(maxitr=3)
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: unknown option 'maxitr' for run(); did you mean 'maxiter'?
    """
    params = inspect.signature(fn).parameters
    keywords = sorted(n for n, p in params.items() if p.kind is not inspect.Parameter.POSITIONAL_ONLY)

    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        for name in kwargs:
            if name not in keywords:
                close = difflib.get_close_matches(name, keywords, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"valid options: {', '.join(keywords)}"
                raise InvalidOptionError(f"unknown option {name!r} for {fn.__name__}(); {hint}")
        return fn(*args, **kwargs)

    return checked


def worker_tuple(value: object) -> object:
    """A sequence of worker addresses as a tuple; anything else (a single string too) as it is, for
    :func:`check_fields`'s callers to refuse (``tuple("tcp://...")`` would be its characters).

    Examples
    --------
    >>> worker_tuple(["tcp://a:1"]), worker_tuple("tcp://a:1")
    (('tcp://a:1',), 'tcp://a:1')
    """
    if value is None or isinstance(value, str | bytes):
        return value
    try:
        return tuple(value)  # type: ignore[arg-type]
    except TypeError:
        return value


def rest_model(
    cls: type,
    name: str,
    *,
    base: type,
    doc: str,
    types_: Mapping[str, Any] | None = None,
) -> Any:
    """The pydantic model of ``cls``'s REST options: every one optional (unset takes the default).

    Each option declared with ``rest=True`` becomes ``Annotated[T, Field(ge, gt, le, description)] |
    None`` with ``T`` its type without ``None`` (``float`` finite), ``le`` its ``rest_le`` if it has one;
    ``types_`` replaces ``T`` where the JSON form differs (an object for a dataclass).
    ``base`` brings the config (strict, ``extra="forbid"``) and validators between fields.
    """
    from pydantic import Field, create_model

    hints = _hints(cls)
    fields: dict[str, Any] = {}
    for f, spec in _options(cls):
        if not spec.rest:
            continue
        inner, _ = _split_none(hints[f.name])
        inner = (types_ or {}).get(f.name, inner)
        limits: dict[str, Any] = {"ge": spec.ge, "gt": spec.gt, "le": spec.rest_le or spec.le}
        if inner is float:
            limits["allow_inf_nan"] = False
        field = Field(description=spec.doc or None, **{k: v for k, v in limits.items() if v is not None})
        fields[f.name] = (typing.Annotated[inner, field] | None, None)
    return create_model(name, __base__=base, __doc__=doc, __module__=base.__module__, **fields)
