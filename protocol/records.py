"""Typed msgpack arrays: the one encoding that messages and their payloads share.

A ``WireRecord`` is a frozen dataclass that travels as a msgpack array of its
fields in declaration order and is checked field by field when it arrives.
The socket edge is the one place where a peer's bytes become Python objects,
so it is the one place that decides whether they are what they claim to be:
past ``from_body`` nobody re-checks a type, and nothing a peer sends can blow
up later in the broker's loop (a heartbeat with a string where a number
belongs used to do exactly that, in the ledger's KV-cache and Retry-After
arithmetic on the next STATUS or NO_SLOT).

A record is declared once, as a dataclass under ``@wire_record``; each
field's annotation is also what the socket edge accepts for it (its kind)::

    @wire_record
    class JobProgress(WireRecord):
        job_id: str
        n_prompt: Annotated[int, COUNT] = 0
        pause_ends_in_s: Annotated[float, NON_NEGATIVE] | None = None

A plain annotation gives its kind by rule:

* ``str``, ``int``, ``bool``, ``bytes``: a scalar of exactly that type as
  msgpack decodes it, so ``bool`` is never accepted where a number is meant;
  ``float``: an int or a float (msgpack keeps ``2`` an int);
* ``list[X]``: ``ListOf(kind of X)``; ``X | None``: ``Optional(kind of X)``;
  ``dict[K, V]`` of scalars: ``MapOf`` (open-ended names: counters);
* another ``WireRecord`` class: a nested array, decoded and checked by it.

A kind that checks more than the type goes in ``Annotated[T, kind]``:

* ``Count()`` (``COUNT``), ``NonNegative()`` (``NON_NEGATIVE``) and
  ``Finite()`` (``FINITE``): a number whose range is checked too (a token
  count, a duration, a rate, a log-probability), so NaN, infinity or a
  negative never reaches arithmetic, JSON or a Prometheus counter;
* ``Text(max_chars)``: a string of bounded length (``protocol.limits``);
* ``OneOf(*values)``: a string from a closed set;
* ``PackedUInts(size)`` (``TOKEN_IDS``): bytes of fixed-size unsigned
  integers (token ids);
* a tuple of Python types, for a scalar the rule does not give.

The kinds are worked out once, when the class is created (``FIELD_TYPES``,
and the checks and packers the hot path uses), never per message.

New optional fields go at the end with defaults, so an older peer's shorter
array still decodes, and a newer peer's extra trailing fields are ignored.
That holds at every level of nesting.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Union


class MalformedMessage(ValueError):
    """A frame sequence that is not a valid message of this protocol version."""


class ListOf:
    """A msgpack array whose every item is of ``item`` kind."""

    def __init__(self, item: Kind) -> None:
        self.item = item
        self._check_item = _checker(item)
        self._pack_item = _packer(item)

    def check(self, value: Any, where: str) -> list:
        if value.__class__ is not list:
            raise MalformedMessage(f"{where}: {type(value).__name__}, not an array")
        check = self._check_item
        if type(check) is frozenset:
            # Scalars: one pass with no per-item call (prompt_tokens can hold
            # thousands of ids).
            for item in value:
                if item.__class__ not in check:
                    raise MalformedMessage(f"{where}[]: {type(item).__name__}")
            return value
        return [check.check(item, f"{where}[{i}]") for i, item in enumerate(value)]

    def pack(self, value: list) -> list:
        pack = self._pack_item
        return value if pack is None else [pack(item) for item in value]


class MapOf:
    """A msgpack map with scalar keys and values (open-ended names: counters)."""

    def __init__(self, key_types: tuple[type, ...],
                 value_types: tuple[type, ...]) -> None:
        self.key_types = key_types
        self.value_types = value_types
        self._keys = frozenset(key_types)
        self._values = frozenset(value_types)

    def check(self, value: Any, where: str) -> dict:
        if value.__class__ is not dict:
            raise MalformedMessage(f"{where}: {type(value).__name__}, not a map")
        for key, item in value.items():
            if key.__class__ not in self._keys or item.__class__ not in self._values:
                raise MalformedMessage(
                    f"{where}: {type(key).__name__} -> {type(item).__name__}")
        return value

    def pack(self, value: dict) -> dict:
        return value


class Optional:
    """``None`` (msgpack nil), or a value of ``kind``."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self._inner = _checker(kind)
        self._pack = _packer(kind)

    def check(self, value: Any, where: str) -> Any:
        if value is None:
            return None
        inner = self._inner
        if type(inner) is frozenset:
            if value.__class__ not in inner:
                raise MalformedMessage(f"{where}: {type(value).__name__}")
            return value
        return inner.check(value, where)

    def pack(self, value: Any) -> Any:
        return value if value is None or self._pack is None else self._pack(value)


class Text:
    """A string of at most ``max_chars`` characters: for what a receiver keeps
    (a host name in the ledger), so that a peer cannot park a megabyte there
    with a message that is otherwise valid."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars

    def check(self, value: Any, where: str) -> str:
        if value.__class__ is not str:
            raise MalformedMessage(f"{where}: {type(value).__name__}")
        if len(value) > self.max_chars:
            raise MalformedMessage(
                f"{where}: {len(value)} characters, at most {self.max_chars}")
        return value

    def pack(self, value: str) -> str:
        return value


class OneOf:
    """A string from a closed set (a request's kind, a chat role)."""

    def __init__(self, *values: str) -> None:
        self.values = frozenset(values)

    def check(self, value: Any, where: str) -> str:
        if value.__class__ is not str or value not in self.values:
            shown = repr(value[:32]) if isinstance(value, str) else type(
                value).__name__
            raise MalformedMessage(f"{where}: {shown} is not one of "
                                   f"{sorted(self.values)}")
        return value

    def pack(self, value: str) -> str:
        return value


#: The largest count accepted: the largest integer a JSON client (JavaScript)
#: still reads exactly. No real count comes near it.
MAX_COUNT = 2**53 - 1


class Count:
    """A non-negative integer (a number of tokens), at most ``MAX_COUNT``;
    ``minimum`` and ``maximum`` narrow the range (e.g. a thread count)."""

    def __init__(self, minimum: int = 0, maximum: int = MAX_COUNT) -> None:
        self.minimum, self.maximum = minimum, maximum

    def check(self, value: Any, where: str) -> int:
        if value.__class__ is not int:
            raise MalformedMessage(f"{where}: {type(value).__name__}")
        if not self.minimum <= value <= self.maximum:
            raise MalformedMessage(f"{where}: {value} is out of range")
        return value

    def pack(self, value: int) -> int:
        return value


class NonNegative:
    """A finite number >= 0 (a duration, a rate); an int is taken as a float."""

    def check(self, value: Any, where: str) -> float:
        if value.__class__ is not float and value.__class__ is not int:
            raise MalformedMessage(f"{where}: {type(value).__name__}")
        if not (math.isfinite(value) and value >= 0):
            raise MalformedMessage(f"{where}: {value!r} is not a finite number >= 0")
        return float(value)

    def pack(self, value: float) -> float:
        return value


class Finite:
    """A finite number (a log-probability); an int is taken as a float."""

    def check(self, value: Any, where: str) -> float:
        if value.__class__ is not float and value.__class__ is not int:
            raise MalformedMessage(f"{where}: {type(value).__name__}")
        if not math.isfinite(value):
            raise MalformedMessage(f"{where}: {value!r} is not finite")
        return float(value)

    def pack(self, value: float) -> float:
        return value


class PackedUInts:
    """Bytes holding unsigned integers of ``size`` bytes each, little-endian
    (``TOKEN_IDS``: a frame's token ids). One msgpack bin rather than an
    array: a frame may cover every token held back behind a long stop string,
    more than the array limits allow, and a bin costs one object to decode."""

    def __init__(self, size: int) -> None:
        self.size = size

    def check(self, value: Any, where: str) -> bytes:
        if value.__class__ is not bytes:
            raise MalformedMessage(f"{where}: {type(value).__name__}")
        if len(value) % self.size:
            raise MalformedMessage(f"{where}: {len(value)} bytes, not a multiple "
                                   f"of {self.size}")
        return value

    def pack(self, value: bytes) -> bytes:
        return value


#: The range kinds with nothing to narrow, shared: ``Annotated[int, COUNT]``.
COUNT = Count()
NON_NEGATIVE = NonNegative()
FINITE = Finite()
#: Token ids (``PackedUInts(4)``): ``protocol.messages.pack_token_ids``.
TOKEN_IDS = PackedUInts(4)


Kind = Union[tuple, ListOf, MapOf, Optional, OneOf, Text, Count, NonNegative,
             Finite, PackedUInts, "type[WireRecord]"]


def _checker(kind: Kind):
    """How a kind is checked: a set of exact types for a scalar, else itself."""
    return frozenset(kind) if isinstance(kind, tuple) else kind


def _packer(kind: Kind):
    """A function that makes a value msgpack-ready, or None if it already is."""
    if isinstance(kind, type) and issubclass(kind, WireRecord):
        return kind.to_body
    if isinstance(kind, (ListOf, Optional)):
        inner = kind._pack_item if isinstance(kind, ListOf) else kind._pack
        return None if inner is None else kind.pack
    return None


@dataclasses.dataclass(frozen=True)
class WireRecord:
    """Base class: a frozen dataclass that travels as a checked msgpack array.

    Subclasses are declared with ``@wire_record``: each field's annotation
    gives its kind.
    """

    #: field name -> kind, in field order, as the annotations give them.
    FIELD_TYPES: ClassVar[dict[str, Kind]]
    # Precomputed by ``wire_record`` so that encoding and decoding a TOKEN
    # (the hot path) costs no reflection.
    _NAMES: ClassVar[tuple[str, ...]]
    _CHECKS: ClassVar[tuple]
    #: Every field's value as a tuple, in one C call (``operator.attrgetter``).
    _VALUES: ClassVar[Callable[[Any], tuple]]
    #: (index, packer) of the fields that are not msgpack-ready as they are.
    _PACK_AT: ClassVar[tuple[tuple[int, Callable[[Any], Any]], ...]]
    _REQUIRED: ClassVar[int]

    def to_body(self) -> list:
        """The msgpack-ready array of this record's fields, nested ones too."""
        values = list(self._VALUES(self))
        for i, pack in self._PACK_AT:
            values[i] = pack(values[i])
        return values

    @classmethod
    def from_body(cls, body: Any, where: str = "") -> WireRecord:
        """Build from a decoded msgpack array, checking every field.

        Raises:
            MalformedMessage: naming the first bad field by its path.
        """
        where = where or cls.__name__
        if body.__class__ is not list:
            raise MalformedMessage(f"{where}: body is not an array")
        if len(body) < cls._REQUIRED:
            raise MalformedMessage(
                f"{where}: {len(body)} fields, need {cls._REQUIRED}"
            )
        # Extra trailing fields come from a newer peer; zip ignores them.
        values = {}
        for name, check, value in zip(cls._NAMES, cls._CHECKS, body):
            if type(check) is frozenset:
                if value.__class__ not in check:
                    raise MalformedMessage(
                        f"{where}.{name}: {type(value).__name__}")
            else:
                value = check.check(value, f"{where}.{name}")
            values[name] = value
        return cls(**values)

    # A record class is itself a kind: a nested array.
    @classmethod
    def check(cls, value: Any, where: str) -> WireRecord:
        return cls.from_body(value, where)


def _values_getter(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    if len(names) == 1:  # attrgetter of one name returns the bare value
        name = names[0]
        return lambda record: (getattr(record, name),)
    return operator.attrgetter(*names)


def wire_record(cls: type[WireRecord]) -> type[WireRecord]:
    """Class decorator: make ``cls`` a frozen dataclass whose fields are
    checked, on the wire, against the kinds their annotations give.

    Raises:
        TypeError: an annotation that names nothing defined before the
            class, or that has no kind.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    try:
        # The module's globals hold every name defined before the class.
        hints = typing.get_type_hints(cls, include_extras=True)
    except NameError as exc:
        raise TypeError(
            f"{cls.__name__}: cannot resolve its annotations ({exc}); a wire "
            f"field's type may name only what its module defines before the "
            f"class") from None
    field_types = {f.name: _kind_of(hints[f.name], f"{cls.__name__}.{f.name}")
                   for f in fields}
    names = tuple(field_types)
    cls.FIELD_TYPES = field_types
    cls._NAMES = names
    cls._CHECKS = tuple(_checker(field_types[n]) for n in names)
    cls._VALUES = staticmethod(_values_getter(names))
    cls._PACK_AT = tuple(
        (i, pack)
        for i, pack in enumerate(_packer(field_types[n]) for n in names)
        if pack is not None
    )
    cls._REQUIRED = sum(
        1
        for f in fields
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    )
    return cls


#: The kind of each plain scalar annotation. ``float`` takes an int too:
#: msgpack keeps a whole number an int, whatever the sender meant.
_SCALAR_KINDS: dict[type, tuple[type, ...]] = {
    str: (str,),
    int: (int,),
    float: (int, float),
    bool: (bool,),
    bytes: (bytes,),
}

#: The one plain type each refined kind narrows, so that a kind cannot
#: silently contradict its annotation (``Annotated[float | None, FINITE]``
#: would refuse the None the annotation promises).
_REFINES: dict[type, type] = {
    Count: int,
    NonNegative: float,
    Finite: float,
    Text: str,
    OneOf: str,
    PackedUInts: bytes,
}

_KIND_CLASSES = (ListOf, MapOf, Optional, OneOf, Text, Count, NonNegative, Finite,
                 PackedUInts)


def _kind_of(annotation: Any, where: str) -> Kind:
    """The wire kind that a field's resolved annotation declares.

    Raises:
        TypeError: naming ``where`` (``Class.field``) when there is none.
    """
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Annotated:
        kinds = [m for m in annotation.__metadata__ if _is_kind(m)]
        if len(kinds) != 1:
            raise TypeError(f"{where}: Annotated[...] needs exactly one wire "
                            f"kind, got {len(kinds)}")
        kind, base = kinds[0], args[0]
        expected = _REFINES.get(type(kind))
        if expected is not None and base is not expected:
            raise TypeError(f"{where}: {type(kind).__name__} refines "
                            f"{expected.__name__}, not {_shown(base)} (an "
                            f"optional one is Annotated[{expected.__name__}, "
                            f"kind] | None)")
        return kind
    if origin is typing.Union or origin is types.UnionType:
        rest = [a for a in args if a is not type(None)]
        if len(args) == 2 and len(rest) == 1:
            return Optional(_kind_of(rest[0], where))
    elif origin is list and len(args) == 1:
        return ListOf(_kind_of(args[0], f"{where}[]"))
    elif origin is dict and len(args) == 2:
        key, value = (_kind_of(a, f"{where}{{}}") for a in args)
        if isinstance(key, tuple) and isinstance(value, tuple):
            return MapOf(key, value)
    elif origin is None and isinstance(annotation, type):
        if annotation in _SCALAR_KINDS:
            return _SCALAR_KINDS[annotation]
        if issubclass(annotation, WireRecord):
            return annotation
    raise TypeError(
        f"{where}: no wire kind for {_shown(annotation)}; use str, int, float, "
        f"bool, bytes, list[X], X | None, dict of scalars or a WireRecord, or "
        f"give the kind in Annotated[T, kind]")


def _shown(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else repr(annotation)


def _is_kind(value: Any) -> bool:
    if isinstance(value, _KIND_CLASSES):
        return True
    if isinstance(value, type):
        return issubclass(value, WireRecord)
    return (isinstance(value, tuple) and bool(value)
            and all(isinstance(t, type) for t in value))
