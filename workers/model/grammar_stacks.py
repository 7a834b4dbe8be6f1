"""How many parse stacks llama.cpp's grammar engine keeps, bounded.

llama.cpp keeps one stack per way of reaching the next terminal, and every
token it checks walks every stack. Nested optional rules (``r0 ::= r1?
r1?``, ``r1 ::= r2? r2?``, ...) make 2^depth of them from a few hundred
bytes: one C call then runs for minutes and cannot be interrupted. The
grammar's size and nesting limits do not see this, so the work is bounded
instead, twice:

* ``worst_stacks``, from the rules alone, before llama.cpp sees them: the
  stacks at the start, and the most that one stack can turn into when a
  character is accepted (a memoised count of the ways through nullable
  rules to a terminal, and of what lies under a rule that ends). Linear in
  the grammar's size. The frontend refuses a grammar over the budget with a
  400, and the worker again before it compiles one.
* ``LiveStacks``, in the worker, follows the accepted tokens as llama.cpp
  does, on the same positions (``workers.model.gbnf_parse``), and raises
  before the C call that would pass the budget. This catches what the
  rules alone do not show: an ambiguous grammar (two alternatives that both
  match) whose stacks multiply with the text generated.

Counts saturate just above the budget, so a count is exact up to it and
"more" beyond it.
"""

from __future__ import annotations

from workers.model.gbnf_parse import (
    ALT,
    CHAR,
    CHAR_ALT,
    CHAR_ANY,
    CHAR_NOT,
    CHAR_RNG_UPPER,
    END,
    RULE_REF,
    TOKEN,
    TOKEN_NOT,
    ParsedGrammar,
)

#: The most stacks a grammar may keep. Each token checked walks every stack
#: over the whole vocabulary: on Gemma's 262k tokens one stack costs about
#: 1.4 ms per token over a 43 ms base (AMD EPYC, 2 cores), so 128 is about
#: 5x the base; everyday schemas keep 3 to 40 (docs/api.md).
MAX_GRAMMAR_STACKS = 128

_TERMINALS = (CHAR, CHAR_NOT, CHAR_ANY, TOKEN, TOKEN_NOT)
_CHARS = (CHAR, CHAR_NOT, CHAR_ANY)


class GrammarRefused(ValueError):
    """The grammar would keep more parse stacks than the budget allows."""


class _Flat:
    """The rules in one array, as llama.cpp addresses them: a position is an
    index, a stack a tuple of positions."""

    def __init__(self, grammar: ParsedGrammar) -> None:
        self.elems: list[tuple[int, int]] = []
        self.start: list[int] = []
        for rule in grammar.rules:
            self.start.append(len(self.elems))
            self.elems += rule
        self.root = grammar.root

    def alternatives(self, rule_id: int) -> list[int]:
        """The first position of each of a rule's alternatives."""
        pos, found = self.start[rule_id], []
        while True:
            found.append(pos)
            while self.elems[pos][0] not in (ALT, END):
                pos += 1
            if self.elems[pos][0] == END:
                return found
            pos += 1

    def is_end(self, pos: int) -> bool:
        return self.elems[pos][0] in (ALT, END)

    def after_terminal(self, pos: int) -> int:
        pos += 1
        while self.elems[pos][0] in (CHAR_ALT, CHAR_RNG_UPPER):
            pos += 1
        return pos

    def match_char(self, pos: int, chr_: int) -> bool:
        kind = self.elems[pos][0]
        found = False
        while True:
            value = self.elems[pos][1]
            if self.elems[pos + 1][0] == CHAR_RNG_UPPER:
                found = found or value <= chr_ <= self.elems[pos + 1][1]
                pos += 2
            elif self.elems[pos][0] == CHAR_ANY:
                found, pos = True, pos + 1
            else:
                found, pos = found or value == chr_, pos + 1
            if self.elems[pos][0] != CHAR_ALT:
                return found == (kind != CHAR_NOT)


# --- the bound from the rules ---------------------------------------------------


class _Counts:
    """For each position: how many terminal-topped stacks expanding it
    makes within its own rule (``ways``), and whether it can reach the
    rule's end without a terminal (``nullable``)."""

    def __init__(self, flat: _Flat, cap: int) -> None:
        self.flat, self.cap = flat, cap
        n = len(flat.elems)
        self.ways = [0] * n
        self.nullable = [False] * n
        self.rule_ways: dict[int, int] = {}
        self.rule_nullable: dict[int, bool] = {}
        self._summarise_rules()
        for rule_id in range(len(flat.start)):
            for alt in flat.alternatives(rule_id):
                self._fill_alternative(alt)

    def _summarise_rules(self) -> None:
        """``rule_ways``/``rule_nullable`` for every rule, dependencies first
        (only the leftmost rules of an alternative are needed, and llama.cpp
        refuses left recursion, so there is an order), without recursion."""
        in_progress: set[int] = set()
        for first in range(len(self.flat.start)):
            todo = [first]
            while todo:
                rule_id = todo[-1]
                if rule_id in self.rule_ways:
                    todo.pop()
                    continue
                needed = self._summarise(rule_id)
                if needed is None:
                    todo.pop()
                    in_progress.discard(rule_id)
                elif needed in in_progress:
                    raise GrammarRefused("left recursion")
                else:
                    in_progress.add(rule_id)
                    todo.append(needed)

    def _summarise(self, rule_id: int) -> int | None:
        """Summarise one rule, or return a rule it needs first."""
        total, nullable = 0, False
        elems = self.flat.elems
        for pos in self.flat.alternatives(rule_id):
            while True:
                kind, value = elems[pos]
                if kind in _TERMINALS:
                    total += 1
                    break
                if kind in (ALT, END):
                    nullable = True
                    break
                if value not in self.rule_ways:
                    return value
                total += self.rule_ways[value]
                if not self.rule_nullable[value]:
                    break
                pos += 1
        self.rule_ways[rule_id] = min(total, self.cap)
        self.rule_nullable[rule_id] = nullable
        return None

    def _fill_alternative(self, first: int) -> None:
        elems, end = self.flat.elems, first
        while elems[end][0] not in (ALT, END):
            end += 1
        self.nullable[end] = True
        for pos in range(end - 1, first - 1, -1):
            kind, value = elems[pos]
            if kind in _TERMINALS:
                self.ways[pos] = 1
            elif kind == RULE_REF:
                rest = self.rule_nullable[value]
                self.ways[pos] = min(
                    self.rule_ways[value] + (self.ways[pos + 1] if rest else 0),
                    self.cap)
                self.nullable[pos] = rest and self.nullable[pos + 1]


def _under_rules(flat: _Flat, counts: _Counts, cap: int) -> list[int]:
    """For each rule, the most stacks that one expansion ending that rule
    turns into: what lies under it, after each place that refers to it.

    ``under[s] = max over refs (r, i) to s of ways(i+1) + [nullable(i+1)] *
    under[r]``, and 1 for the root (the empty, accepting stack). A cycle of
    such references that adds stacks on the way grows with the text, so
    its rules get the cap. Solved on the strongly connected components of
    the references, in dependency order (iterative Tarjan)."""
    n_rules = len(flat.start)
    base = [0] * n_rules
    base[flat.root] = 1
    edges: list[list[tuple[int, int]]] = [[] for _ in range(n_rules)]
    rule_of = []
    for rule_id in range(n_rules):
        end = flat.start[rule_id + 1] if rule_id + 1 < n_rules else len(flat.elems)
        rule_of += [rule_id] * (end - flat.start[rule_id])
    for pos, (kind, value) in enumerate(flat.elems):
        if kind != RULE_REF:
            continue
        ways = counts.ways[pos + 1]
        base[value] = max(base[value], ways)
        if counts.nullable[pos + 1]:
            edges[value].append((rule_of[pos], ways))
    under = [0] * n_rules
    for component in _components(edges):
        members = set(component)
        grows = any(r in members and w > 0
                    for s in component for r, w in edges[s])
        best = max(base[s] for s in component)
        for s in component:
            for r, w in edges[s]:
                if r not in members:
                    best = max(best, w + under[r])
        value = cap if grows else min(best, cap)
        for s in component:
            under[s] = value
    return under


def _components(edges: list[list[tuple[int, int]]]) -> list[list[int]]:
    """Tarjan's strongly connected components, each after those it points
    to, without recursion."""
    n = len(edges)
    index, low, on_stack = [-1] * n, [0] * n, [False] * n
    stack: list[int] = []
    found: list[list[int]] = []
    counter = 0
    for root in range(n):
        if index[root] >= 0:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack[node] = True
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i][0]
                if index[nxt] < 0:
                    work.append((nxt, 0))
                elif on_stack[nxt]:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack[member] = False
                    component.append(member)
                    if member == node:
                        break
                found.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def worst_stacks(grammar: ParsedGrammar, budget: int = MAX_GRAMMAR_STACKS) -> int:
    """The most stacks llama.cpp builds at the start, or from one stack when
    a character or token is accepted; ``budget + 1`` means "more than the
    budget".

    Raises:
        GrammarRefused: left recursion (llama.cpp refuses it too).
    """
    cap = budget + 1
    flat = _Flat(grammar)
    counts = _Counts(flat, cap)
    under = _under_rules(flat, counts, cap)
    worst = min(counts.rule_ways[flat.root] + counts.rule_nullable[flat.root], cap)
    rule_id = 0
    for pos, (kind, _) in enumerate(flat.elems):
        while rule_id + 1 < len(flat.start) and flat.start[rule_id + 1] <= pos:
            rule_id += 1
        if kind not in _TERMINALS:
            continue
        nxt = flat.after_terminal(pos)
        ways = counts.ways[nxt] + (under[rule_id] if counts.nullable[nxt] else 0)
        worst = max(worst, min(ways, cap))
        if worst >= cap:
            break
    return worst


# --- the stacks as they are -------------------------------------------------------


class LiveStacks:
    """llama.cpp's stacks for one request, followed token by token
    (``llama_grammar_accept_impl``), so that a token that would pass the
    budget is refused before llama.cpp accepts it.

    Args:
        grammar: the request's rules, with its tokens resolved.
        budget: the most stacks allowed.
    """

    def __init__(self, grammar: ParsedGrammar, budget: int = MAX_GRAMMAR_STACKS) -> None:
        self.flat = _Flat(grammar)
        self.budget = budget
        self._partial = (0, 0)  # llama_partial_utf8: value, bytes to come
        found: dict[tuple[int, ...], None] = {}
        for alt in self.flat.alternatives(self.flat.root):
            self._advance(() if self.flat.is_end(alt) else (alt,), found)
        self.stacks = list(found)

    def __len__(self) -> int:
        return len(self.stacks)

    def accept(self, token: int, piece: bytes) -> None:
        """Advance by one generated token (not an end-of-generation one).

        Raises:
            GrammarRefused: more stacks than the budget; the caller
                must not hand the token to llama.cpp.
        """
        code_points, partial = _decode_utf8(piece, self._partial)
        elems = self.flat.elems
        found: dict[tuple[int, ...], None] = {}
        for stack in self.stacks:
            if not stack:
                continue
            kind, value = elems[stack[-1]]
            if kind in (TOKEN, TOKEN_NOT):
                if (value == token) == (kind == TOKEN):
                    self._advance(self._popped(stack, stack[-1] + 1), found)
                continue
            current = [stack]
            for chr_ in code_points:
                nxt: dict[tuple[int, ...], None] = {}
                for cur in current:
                    self._accept_chr(cur, chr_, nxt)
                current = list(nxt)
                if not current:
                    break
            for cur in current:
                found[cur] = None
                self._check(found)
        if not found:
            # llama.cpp would throw from inside its C call here, and the
            # exception would end the process.
            raise GrammarRefused("the grammar does not allow this token")
        self.stacks = list(found)
        self._partial = partial

    def _accept_chr(self, stack: tuple[int, ...], chr_: int,
                    found: dict[tuple[int, ...], None]) -> None:
        if not stack or self.flat.elems[stack[-1]][0] not in _CHARS:
            return
        if self.flat.match_char(stack[-1], chr_):
            self._advance(self._popped(stack, self.flat.after_terminal(stack[-1])),
                          found)

    def _popped(self, stack: tuple[int, ...], nxt: int) -> tuple[int, ...]:
        """The stack with its top replaced by the position after it."""
        return stack[:-1] if self.flat.is_end(nxt) else stack[:-1] + (nxt,)

    def _advance(self, stack: tuple[int, ...],
                 found: dict[tuple[int, ...], None]) -> None:
        """``llama_grammar_advance_stack``: every terminal-topped (or empty)
        stack this one expands to, into ``found``."""
        elems, flat = self.flat.elems, self.flat
        todo, seen = [stack], set()
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            if not cur or elems[cur[-1]][0] in _TERMINALS:
                found[cur] = None
                self._check(found)
                continue
            pos = cur[-1]
            below = cur[:-1] if flat.is_end(pos + 1) else cur[:-1] + (pos + 1,)
            for alt in flat.alternatives(elems[pos][1]):
                todo.append(below if flat.is_end(alt) else below + (alt,))
            if len(seen) > 64 * self.budget:
                raise GrammarRefused(
                    f"the grammar expands past {self.budget} parse stacks")

    def _check(self, found: dict) -> None:
        if len(found) > self.budget:
            raise GrammarRefused(
                f"the grammar would keep more than {self.budget} parse stacks")


def _decode_utf8(piece: bytes, partial: tuple[int, int]
                 ) -> tuple[list[int], tuple[int, int]]:
    """llama.cpp's ``decode_utf8`` with a partial sequence carried over: the
    complete code points, and what is left (``n_remain`` -1: invalid)."""
    value, n_remain = partial
    pos, out = 0, []
    while pos < len(piece) and n_remain > 0:
        byte = piece[pos]
        if byte >> 6 != 2:
            return [], (0, -1)
        value, pos, n_remain = (value << 6) + (byte & 0x3F), pos + 1, n_remain - 1
    if partial[1] > 0 and n_remain == 0:
        out.append(value)
    while pos < len(piece) and piece[pos] != 0:
        first = piece[pos]
        n_remain = (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4)[first >> 4] - 1
        if n_remain < 0:
            return [], (0, n_remain)
        value = first & ((1 << (7 - n_remain)) - 1)
        pos += 1
        while pos < len(piece) and piece[pos] != 0 and n_remain > 0:
            value, pos, n_remain = (value << 6) + (piece[pos] & 0x3F), pos + 1, n_remain - 1
        if n_remain == 0:
            out.append(value)
    return out, (value, n_remain)
