"""GBNF parsed as llama.cpp parses it, into the same flat rules.

``llama-grammar.cpp``'s parser, line for line (``parse_sequence``,
``handle_repetitions``, its symbol ids), so that a position here is a
position there, with one difference: ``{m,n}`` with n < m is refused here,
where llama.cpp allocates until the process is killed. ``workers.model.grammar_stacks`` counts the parse stacks
llama.cpp's grammar engine will keep, and follows them token by token,
without running that engine. It must run first: llama.cpp builds its
initial stacks inside the one C call that compiles a grammar, and a grammar
of 300 bytes can make that call run for minutes.

A rule is a list of ``(type, value)`` elements; alternatives are separated
by ``ALT`` and the rule ends with ``END``, as in llama.cpp. A character
class is one ``CHAR``/``CHAR_NOT`` element followed by ``CHAR_ALT`` and
``CHAR_RNG_UPPER`` elements. A ``<token>`` written as text, which needs the
model's vocabulary, is resolved by ``token_id`` when one is given, else it
stays -1 (its id does not change how many stacks there are).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

END, ALT, RULE_REF, CHAR, CHAR_NOT, CHAR_RNG_UPPER, CHAR_ALT, CHAR_ANY, \
    TOKEN, TOKEN_NOT = range(10)
#: llama.cpp's ``MAX_REPETITION_THRESHOLD``.
MAX_REPETITION = 2000
_UNBOUNDED = -1
_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", "\"": "\"",
            "[": "[", "]": "]", "-": "-"}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}

Element = tuple[int, int]


class GbnfSyntaxError(ValueError):
    """llama.cpp's parser would refuse this text; the message says where."""


@dataclasses.dataclass(frozen=True)
class ParsedGrammar:
    rules: list[list[Element]]
    root: int


def _is_word_char(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


class _Parser:
    def __init__(self, text: str, token_id: Callable[[str], int] | None) -> None:
        self.src = text
        self.token_id = token_id
        self.symbol_ids: dict[str, int] = {}
        self.rules: list[list[Element] | None] = []

    # --- characters ------------------------------------------------------------

    def at(self, pos: int) -> str:
        return self.src[pos] if pos < len(self.src) else "\0"

    def fail(self, what: str, pos: int) -> GbnfSyntaxError:
        return GbnfSyntaxError(f"{what} at {self.src[pos:pos + 20]!r}")

    def space(self, pos: int, newline_ok: bool) -> int:
        while True:
            c = self.at(pos)
            if c == "#":
                while self.at(pos) not in "\r\n\0":
                    pos += 1
            elif c in " \t" or (newline_ok and c in "\r\n"):
                pos += 1
            else:
                return pos

    def name_end(self, pos: int) -> int:
        end = pos
        while _is_word_char(self.at(end)):
            end += 1
        if end == pos:
            raise self.fail("expecting name", pos)
        return end

    def int_end(self, pos: int) -> int:
        end = pos
        while self.at(end).isascii() and self.at(end).isdigit():
            end += 1
        if end == pos:
            raise self.fail("expecting integer", pos)
        return end

    def char(self, pos: int) -> tuple[int, int]:
        c = self.at(pos)
        if c == "\\":
            kind = self.at(pos + 1)
            if kind in _HEX_DIGITS:
                size = _HEX_DIGITS[kind]
                digits = self.src[pos + 2:pos + 2 + size]
                if len(digits) != size or any(d not in "0123456789abcdefABCDEF"
                                              for d in digits):
                    raise self.fail(f"expecting {size} hex chars", pos)
                return int(digits, 16), pos + 2 + size
            if kind in _ESCAPES:
                return ord(_ESCAPES[kind]), pos + 2
            raise self.fail("unknown escape", pos)
        if c == "\0" and pos >= len(self.src):
            raise self.fail("unexpected end of input", pos)
        return ord(c), pos + 1

    def token(self, pos: int) -> tuple[int, int]:
        if self.at(pos) != "<":
            raise self.fail("expecting '<'", pos)
        if self.at(pos + 1) == "[":
            end = self.int_end(pos + 2)
            if self.at(end) != "]" or self.at(end + 1) != ">":
                raise self.fail("expecting ']>'", end)
            value = int(self.src[pos + 2:end])
            if value > 0xFFFFFFFF:
                raise self.fail("token id is too big", pos)
            return value, end + 2
        end = self.src.find(">", pos + 1)
        if end < 0:
            raise self.fail("expecting '>'", pos)
        text = self.src[pos:end + 1]
        return (self.token_id(text) if self.token_id else -1), end + 1

    # --- symbols and rules -----------------------------------------------------

    def symbol_id(self, name: str) -> int:
        return self.symbol_ids.setdefault(name, len(self.symbol_ids))

    def generated_id(self, base: str) -> int:
        next_id = len(self.symbol_ids)
        self.symbol_ids[f"{base}_{next_id}"] = next_id
        return next_id

    def add_rule(self, rule_id: int, rule: list[Element]) -> None:
        while len(self.rules) <= rule_id:
            self.rules.append(None)
        self.rules[rule_id] = rule

    def alternates(self, pos: int, name: str, rule_id: int, nested: bool) -> int:
        rule: list[Element] = []
        pos = self.sequence(pos, name, rule, nested)
        while self.at(pos) == "|":
            rule.append((ALT, 0))
            pos = self.space(pos + 1, True)
            pos = self.sequence(pos, name, rule, nested)
        rule.append((END, 0))
        self.add_rule(rule_id, rule)
        return pos

    def repeat(self, rule: list[Element], last_start: int, name: str,
               low: int, high: int, n_prev: int, pos: int) -> int:
        """``handle_repetitions``: S{m,n} as m copies of S and n-m nested
        optional rules; returns the new count of rules repeated."""
        if last_start == len(rule):
            raise self.fail("expecting preceding item to */+/?/{", pos)
        prev = rule[last_start:]
        total = high if high != _UNBOUNDED and high > 0 else max(low, 1)
        if n_prev * total > MAX_REPETITION:
            raise self.fail("too many repetitions", pos)
        if low == 0:
            del rule[last_start:]
        else:
            rule.extend(prev * (low - 1))
        n_opt = 1 if high == _UNBOUNDED else high - low
        last_rec = 0
        for i in range(n_opt):
            rec_id = self.generated_id(name)
            rec = list(prev)
            if i > 0 or high == _UNBOUNDED:
                rec.append((RULE_REF, rec_id if high == _UNBOUNDED else last_rec))
            rec += [(ALT, 0), (END, 0)]
            self.add_rule(rec_id, rec)
            last_rec = rec_id
        if n_opt > 0:
            rule.append((RULE_REF, last_rec))
        return n_prev * total

    def braces(self, pos: int, nested: bool) -> tuple[int, int, int]:
        """``{m}``, ``{m,}``, ``{m,n}`` from just after ``{``: (m, n, pos)."""
        pos = self.space(pos, nested)
        if not (self.at(pos).isascii() and self.at(pos).isdigit()):
            raise self.fail("expecting an int", pos)
        end = self.int_end(pos)
        low, high = int(self.src[pos:end]), _UNBOUNDED
        pos = self.space(end, nested)
        if self.at(pos) == "}":
            high = low
        elif self.at(pos) == ",":
            pos = self.space(pos + 1, nested)
            if self.at(pos).isascii() and self.at(pos).isdigit():
                end = self.int_end(pos)
                high = int(self.src[pos:end])
                pos = self.space(end, nested)
            if self.at(pos) != "}":
                raise self.fail("expecting '}'", pos)
        else:
            raise self.fail("expecting ','", pos)
        if low > MAX_REPETITION:
            raise self.fail("too many repetitions", pos)
        if high != _UNBOUNDED and high < low:
            # llama.cpp counts max - min optional rules in an unsigned
            # integer: {3,1} asks for 2^64 of them, and the process that
            # compiles the grammar grows until the kernel kills it.
            raise self.fail(f"repetition maximum {high} below its minimum {low}", pos)
        if high != _UNBOUNDED and high > MAX_REPETITION:
            high = _UNBOUNDED
        return low, high, self.space(pos + 1, nested)

    def sequence(self, pos: int, name: str, rule: list[Element],
                 nested: bool) -> int:
        last_start, n_prev = len(rule), 1
        while pos < len(self.src):
            c = self.at(pos)
            if c in "*+?{":
                if c == "{":
                    low, high, pos = self.braces(pos + 1, nested)
                else:
                    low, high = {"*": (0, _UNBOUNDED), "+": (1, _UNBOUNDED),
                                 "?": (0, 1)}[c]
                    pos = self.space(pos + 1, nested)
                n_prev = self.repeat(rule, last_start, name, low, high, n_prev, pos)
                continue
            if c not in "\"[<!(." and not _is_word_char(c):
                break
            last_start, n_prev = len(rule), 1
            pos, n_prev = self.item(pos, name, rule, n_prev)
            pos = self.space(pos, nested)
        return pos

    def item(self, pos: int, name: str, rule: list[Element],
             n_prev: int) -> tuple[int, int]:
        """One symbol from ``pos`` into ``rule``: (the position after it,
        the count of rules it stands for)."""
        c = self.at(pos)
        if c == "\"":
            pos += 1
            while self.at(pos) != "\"":
                if pos >= len(self.src):
                    raise self.fail("unexpected end of input", pos)
                value, pos = self.char(pos)
                rule.append((CHAR, value))
            return pos + 1, n_prev
        if c == "[":
            return self.char_class(pos + 1, rule), n_prev
        if c in "<!":
            kind = TOKEN_NOT if c == "!" else TOKEN
            value, pos = self.token(pos + (c == "!"))
            rule.append((kind, value))
            return pos, n_prev
        if c == "(":
            before = len(self.symbol_ids)
            sub_id = self.generated_id(name)
            pos = self.alternates(self.space(pos + 1, True), name, sub_id, True)
            rule.append((RULE_REF, sub_id))
            if self.at(pos) != ")":
                raise self.fail("expecting ')'", pos)
            return pos + 1, max(1, len(self.symbol_ids) - before)
        if c == ".":
            rule.append((CHAR_ANY, 0))
            return pos + 1, n_prev
        end = self.name_end(pos)
        rule.append((RULE_REF, self.symbol_id(self.src[pos:end])))
        return end, n_prev

    def char_class(self, pos: int, rule: list[Element]) -> int:
        first = CHAR
        if self.at(pos) == "^":
            pos, first = pos + 1, CHAR_NOT
        start = len(rule)
        while self.at(pos) != "]":
            if pos >= len(self.src):
                raise self.fail("unexpected end of input", pos)
            value, pos = self.char(pos)
            rule.append((CHAR_ALT if len(rule) > start else first, value))
            if self.at(pos) == "-" and self.at(pos + 1) != "]":
                if pos + 1 >= len(self.src):
                    raise self.fail("unexpected end of input", pos)
                upper, pos = self.char(pos + 1)
                rule.append((CHAR_RNG_UPPER, upper))
        return pos + 1

    def rule(self, pos: int) -> int:
        end = self.name_end(pos)
        name = self.src[pos:end]
        rule_id = self.symbol_id(name)
        pos = self.space(end, False)
        if self.src[pos:pos + 3] != "::=":
            raise self.fail("expecting ::=", pos)
        pos = self.alternates(self.space(pos + 3, True), name, rule_id, False)
        if self.at(pos) == "\r":
            pos += 2 if self.at(pos + 1) == "\n" else 1
        elif self.at(pos) == "\n":
            pos += 1
        elif pos < len(self.src):
            raise self.fail("expecting newline or end", pos)
        return self.space(pos, True)

    def parse(self) -> ParsedGrammar:
        pos = self.space(0, True)
        while pos < len(self.src):
            pos = self.rule(pos)
        if any(rule is None for rule in self.rules) or \
                len(self.rules) < len(self.symbol_ids):
            missing = [n for n, i in self.symbol_ids.items()
                       if i >= len(self.rules) or self.rules[i] is None]
            raise GbnfSyntaxError(f"undefined rule {missing[0][:40]!r}")
        if "root" not in self.symbol_ids:
            raise GbnfSyntaxError("no 'root' rule")
        return ParsedGrammar([r for r in self.rules if r is not None],
                             self.symbol_ids["root"])


def parse_gbnf(text: str, token_id: Callable[[str], int] | None = None
               ) -> ParsedGrammar:
    """The rules of ``text`` as llama.cpp lays them out.

    Raises:
        GbnfSyntaxError: where llama.cpp's parser would refuse the text.
    """
    return _Parser(text, token_id).parse()
