"""Display filters for ``softrdma dissect -Y``: the small part of Wireshark's filter
language that picks RoCE frames by QP, opcode, PSN and frame number.

A filter is parsed once by a recursive-descent parser into a tree of small nodes, then
asked :meth:`DisplayFilter.matches` for each dissector record (no ``eval``). Grammar::

    expr    := and (("||" | "or") and)*
    and     := not (("&&" | "and") not)*
    not     := ("!" | "not") not | primary
    primary := "(" expr ")" | FIELD [OP VALUE]
    OP      := "==" | "!=" | "<" | "<=" | ">" | ">=" | eq | ne | lt | le | gt | ge

Fields take Wireshark's names or short aliases: ``frame.number`` (``frame``),
``infiniband.bth.destqp`` (``bth.destqp``, ``qp``, ``qpn``), ``infiniband.bth.opcode``
(``bth.opcode``, ``opcode``), ``infiniband.bth.psn`` (``bth.psn``, ``psn``). Values are
numbers (``17``, ``0x11``, ``021`` octal as in Wireshark) or, for the opcode, a name:
softrdma's (``RC_SEND_FIRST``) or Wireshark's (``"RC Send First"``), in any case. A field
alone is true when the frame has it. As in Wireshark, a comparison with a field the frame
lacks (a frame that did not decode has no opcode) is false, whatever the operator.

    >>> from softrdma.wire.dfilter import compile_filter
    >>> f = compile_filter('qp == 0x11 && (opcode == "RC Acknowledge" || psn >= 100)')
    >>> f.matches({"index": 1, "qpn": 0x11, "opcode": 0x11, "psn": 5})
    True
    >>> compile_filter("psn >")
    Traceback (most recent call last):
    ...
    softrdma.wire.dfilter.FilterError: position 6: expected a value after '>'
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .opcodes import Opcode
from .wireshark import WIRESHARK_NAMES

__all__ = ["FIELDS", "FilterError", "DisplayFilter", "compile_filter", "opcode_by_name"]

#: Filter field name -> the dissector record key it reads.
FIELDS: dict[str, str] = {
    "frame.number": "index", "frame": "index",
    "infiniband.bth.destqp": "qpn", "bth.destqp": "qpn", "qp": "qpn", "qpn": "qpn",
    "infiniband.bth.opcode": "opcode", "bth.opcode": "opcode", "opcode": "opcode",
    "infiniband.bth.psn": "psn", "bth.psn": "psn", "psn": "psn",
}

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
    ">": operator.gt, ">=": operator.ge,
}
_WORD_OPS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def _norm(name: str) -> str:
    return " ".join(name.replace("_", " ").lower().split())


# both spellings of every opcode, normalised: "rc send first" and "rc send first"
_OPCODE_NAMES: dict[str, int] = {_norm(op.name): int(op) for op in Opcode}
_OPCODE_NAMES.update({_norm(name): op for op, name in WIRESHARK_NAMES.items()})


def opcode_by_name(name: str) -> int | None:
    """The opcode called ``name`` by softrdma (``RC_SEND_FIRST``) or Wireshark (``RC Send
    First``), case and ``_``/space insensitive; None if no opcode has that name."""
    return _OPCODE_NAMES.get(_norm(name))


class FilterError(ValueError):
    """A filter that does not parse; ``position`` is the 1-based character it stops at."""

    def __init__(self, position: int, message: str) -> None:
        super().__init__(f"position {position}: {message}")
        self.position = position
        self.message = message


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str  # "(", ")", "op", "and", "or", "not", "str", "word", "end"
    text: str
    pos: int  # 1-based


_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<punct>&&|\|\||==|!=|<=|>=|<|>|!|\(|\))
  | (?P<str>"[^"]*"?)
  | (?P<word>[A-Za-z0-9_.:\-]+)
""", re.VERBOSE)


def _tokens(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    i = 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            raise FilterError(i + 1, f"unexpected character {text[i]!r}")
        kind, tok = m.lastgroup, m.group()
        if kind == "str" and (len(tok) < 2 or not tok.endswith('"')):
            raise FilterError(i + 1, "string without its closing '\"'")
        if kind == "punct":
            kind = {"&&": "and", "||": "or", "!": "not", "(": "(", ")": ")"}.get(tok, "op")
        elif kind == "word":
            low = tok.lower()
            if low in ("and", "or", "not"):
                kind = low
            elif low in _WORD_OPS:
                kind, tok = "op", _WORD_OPS[low]
        if kind != "space":
            out.append(_Tok(kind, tok, i + 1))
        i = m.end()
    out.append(_Tok("end", "", len(text) + 1))
    return out


class DisplayFilter:
    """A parsed filter; :meth:`matches` says whether a dissector record passes it."""

    def __init__(self, text: str, test: Callable[[Mapping[str, Any]], bool]) -> None:
        self.text = text
        self._test = test

    def matches(self, rec: Mapping[str, Any]) -> bool:
        """Whether ``rec`` (a :func:`softrdma.wire.dissect.frame_record` dict, or a decode
        error's, which has only ``index``) passes the filter."""
        return self._test(rec)

    def __repr__(self) -> str:
        return f"DisplayFilter({self.text!r})"


def compile_filter(text: str) -> DisplayFilter:
    """Parse ``text``; :class:`FilterError` names the position where it goes wrong."""
    p = _Parser(_tokens(text))
    if p.peek().kind == "end":
        raise FilterError(1, "empty filter")
    test = p.expr()
    end = p.peek()
    if end.kind != "end":
        raise FilterError(end.pos, f"unexpected {end.text!r}"
                          + (" (a missing '&&' or '||'?)" if end.kind in ("word", "str", "(")
                             else ""))
    return DisplayFilter(text, test)


_Test = Callable[[Mapping[str, Any]], bool]


class _Parser:
    """One method per grammar rule; each returns the test of what it parsed."""

    def __init__(self, toks: list[_Tok]) -> None:
        self.toks = toks
        self.i = 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        t = self.toks[self.i]
        self.i += 1
        return t

    def expr(self) -> _Test:
        tests = [self.and_()]
        while self.peek().kind == "or":
            self.take()
            tests.append(self.and_())
        if len(tests) == 1:
            return tests[0]
        return lambda rec: any(t(rec) for t in tests)

    def and_(self) -> _Test:
        tests = [self.not_()]
        while self.peek().kind == "and":
            self.take()
            tests.append(self.not_())
        if len(tests) == 1:
            return tests[0]
        return lambda rec: all(t(rec) for t in tests)

    def not_(self) -> _Test:
        if self.peek().kind == "not":
            self.take()
            inner = self.not_()
            return lambda rec: not inner(rec)
        return self.primary()

    def primary(self) -> _Test:
        t = self.take()
        if t.kind == "(":
            inner = self.expr()
            close = self.take()
            if close.kind != ")":
                raise FilterError(close.pos, "expected ')'"
                                  + (f" before {close.text!r}" if close.text else ""))
            return inner
        if t.kind != "word":
            what = "the end of the filter" if t.kind == "end" else repr(t.text)
            raise FilterError(t.pos, f"expected a field, got {what}")
        key = FIELDS.get(t.text.lower())
        if key is None:
            raise FilterError(t.pos, f"unknown field {t.text!r} (fields: "
                              + ", ".join(FIELDS) + ")")
        if self.peek().kind != "op":
            return lambda rec: rec.get(key) is not None
        op = self.take()
        value = self.value(key, op)
        fn = _OPS[op.text]
        return lambda rec: (v := rec.get(key)) is not None and fn(v, value)

    def value(self, key: str, op: _Tok) -> int:
        t = self.take()
        if t.kind not in ("word", "str"):
            raise FilterError(t.pos, f"expected a value after {op.text!r}")
        text = t.text[1:-1] if t.kind == "str" else t.text
        n = _number(text)
        if n is not None:
            return n
        if key == "opcode":
            code = opcode_by_name(text)
            if code is None:
                raise FilterError(t.pos, f"no opcode is called {text!r}")
            return code
        raise FilterError(t.pos, f"expected a number, got {text!r}")


def _number(text: str) -> int | None:
    """Decimal, ``0x`` hex or leading-``0`` octal, as Wireshark reads integers."""
    if re.fullmatch(r"0[xX][0-9a-fA-F]+", text):
        return int(text[2:], 16)
    if re.fullmatch(r"0[0-7]+", text):
        return int(text[1:], 8)
    return int(text) if re.fullmatch(r"[0-9]+", text) else None
