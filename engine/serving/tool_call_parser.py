"""The Hermes-style tool-call wire format of the local engine (``engine/serving/chat_structured.py`` builds its
grammar and prompt) and ``ToolCallParser``, which turns generated text into OpenAI's ``tool_calls``::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

incrementally (streamed ``delta.tool_calls``: id, type and name first, then argument fragments) or at once (the
non-streamed message is the same parser fed the whole text, so both agree by construction).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from engine.grammar_end import is_json
from engine.serving.chunks import Delta, FunctionPiece, ToolCallPiece

CALL_BEGIN = "<tool_call>"
NAME_PREFIX = '<tool_call>\n{"name": "'
ARGS_PREFIX = '", "arguments": '
CALL_END = "}\n</tool_call>"


@dataclass(frozen=True)
class ToolCallFormat:
    """What the grammar of a chat request with tools admits (``chat_structured.plan_chat``).

    Attributes:
        calls_only: only calls (``tool_choice`` "required" or a named function): no text is ever content, even
            the start of a call's markup.
        names: the function names a call may have (the named one, else every tool's): the grammar writes each
            call's name whole, so a cut inside it is completed when its prefix fits one name.
    """

    calls_only: bool = False
    names: tuple[str, ...] = ()


class ToolCallParser:
    """Splits generated text into content and OpenAI tool calls, incrementally.

    ``feed(text)`` returns the deltas the new text completes (``chunks.Delta``:
    a ``content`` piece, or one ``tool_calls`` piece: a call's index, id, type and
    name first, then pieces of its arguments); ``finish()`` returns the rest. Content is the text outside calls with leading and
    trailing whitespace removed; a call whose output was cut (``length``)
    keeps the arguments generated so far, and one cut inside its name
    (``<tool_call>\n{"name": "get_w``) is that call with empty arguments
    when the name so far is the prefix of one admitted name (the grammar
    would have written the rest), else no call; never content.

    Args:
        fmt: what the grammar admits (``ToolCallFormat``).
    """

    def __init__(self, fmt: ToolCallFormat = ToolCallFormat()) -> None:
        self.calls_only = fmt.calls_only
        self.names = fmt.names
        self._buf = ""
        self._mode = "text"  # "text" | "name" | "args"
        self._pending_ws = ""
        self._started = False
        self.calls: list[dict] = []

    def feed(self, text: str) -> list[Delta]:
        """Deltas completed by ``text`` (may be empty)."""
        self._buf += text
        out: list[Delta] = []
        while True:
            if self._mode == "text":
                at = self._buf.find(CALL_BEGIN)
                if at < 0:
                    keep = _partial_suffix(self._buf, CALL_BEGIN)
                    self._content(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(self._buf[:at], out)
                self._buf = self._buf[at:]
                self._mode = "name"
            elif self._mode == "name":
                end = self._buf.find(ARGS_PREFIX)
                if not (NAME_PREFIX.startswith(self._buf) if len(self._buf) < len(NAME_PREFIX)
                        else self._buf.startswith(NAME_PREFIX)):
                    self._mode = "text"  # not our format after all: plain text
                    self._content(self._buf[: len(CALL_BEGIN)], out)
                    self._buf = self._buf[len(CALL_BEGIN):]
                    continue
                if end < 0:
                    return out
                self._start_call(self._buf[len(NAME_PREFIX):end], out)
                self._buf = self._buf[end + len(ARGS_PREFIX):]
                self._mode = "args"
            else:
                end = self._buf.find(CALL_END)
                upto = end if end >= 0 else len(self._buf) - _partial_suffix(self._buf, CALL_END)
                self._args(self._buf[:upto], out)
                if end < 0:
                    self._buf = self._buf[upto:]
                    return out
                self._buf = self._buf[end + len(CALL_END):]
                self._mode = "text"

    def finish(self, cut: bool = False) -> list[Delta]:
        """Deltas for the text held back at the end of the output; ``cut``: the output was cut (``length``)."""
        out: list[Delta] = []
        if self._mode == "args":
            held = self._buf
            if held and CALL_END.startswith(held) and is_json(self.calls[-1]["function"]["arguments"]):
                held = ""   # the call's own closing ("}\n</tool_call>") began when the output was cut
            self._args(held, out)
        elif self._mode == "name" and len(self._buf) > len(NAME_PREFIX):
            if name := self._cut_name(self._buf[len(NAME_PREFIX):]):
                self._start_call(name, out)
        elif self._buf and not (self.calls_only or self._is_markup_start(cut)):
            self._content(self._buf, out)
        self._buf = ""
        return out

    def _start_call(self, name: str, out: list[Delta]) -> None:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        out.append(Delta(tool_calls=[ToolCallPiece(len(self.calls) - 1, call["id"], "function",
                                                   FunctionPiece(name, ""))]))

    def _cut_name(self, text: str) -> str | None:
        """The name of a call cut inside its markup, ``text`` being what followed ``{"name": "``: the name
        whole when its closing quote was written, else the one admitted name it begins (a trial's tool_use named
        ``get_`` with two tools ``get_*``: an agent looks tools up by name, so a name that fits several is no
        call)."""
        held = _partial_suffix(text, ARGS_PREFIX)
        if held:
            return text[: len(text) - held]
        fits = [n for n in self.names if n.startswith(text)]
        return fits[0] if len(fits) == 1 else None

    def _is_markup_start(self, cut: bool) -> bool:
        """The text kept back at the end is a call's markup cut short: a prefix of ``<tool_call>\n{"name": "``,
        which the grammar forced once ``<tool_call>`` was written, or, in an output the length limit cut, of
        ``<tool_call>`` (a trial's ``<tool_`` after two calls became content: a third call begun, never text the
        model chose to end with)."""
        return self._mode == "name" or cut

    def _content(self, text: str, out: list[Delta]) -> None:
        if not text or self.calls_only:
            return
        stripped = text.rstrip()
        if not stripped:
            if self._started:
                self._pending_ws += text
            return
        if not self._started:
            stripped = stripped.lstrip()
            self._started = True
            out.append(Delta(content=stripped))
        else:
            out.append(Delta(content=self._pending_ws + stripped))
        self._pending_ws = text[len(text.rstrip()):]

    def _args(self, text: str, out: list[Delta]) -> None:
        if text:
            self.calls[-1]["function"]["arguments"] += text
            out.append(Delta(tool_calls=[ToolCallPiece(len(self.calls) - 1, function=FunctionPiece(arguments=text))]))


def parse_tool_calls(text: str, fmt: ToolCallFormat = ToolCallFormat(),
                     cut: bool = False) -> tuple[str | None, list[dict]]:
    """The whole output as (content or None, tool calls) (``fmt``: ``ToolCallParser``'s; ``cut``: the output was
    cut by the length limit, ``finish``'s)."""
    parser = ToolCallParser(fmt)
    deltas = parser.feed(text) + parser.finish(cut)
    content = "".join(d.content for d in deltas if isinstance(d.content, str))
    return content or None, parser.calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
