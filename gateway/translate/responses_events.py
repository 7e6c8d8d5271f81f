"""A chat completions stream as the Responses API's typed events, as a pure state machine (no I/O).

``ResponsesEvents`` is fed the chat stream's events (``gateway.values.ChatEvent``) one by one and answers the
Responses events each one makes, in OpenAI's order: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then for a message per content part ``response.content_part.added``, its deltas
(``response.output_text.delta``... for the text, ``response.refusal.delta``... for the chat deltas' ``refusal``)
and, when the message ends, each part's ``response.output_text.done`` or ``response.refusal.done`` and
``response.content_part.done``; for reasoning (the chat deltas' ``reasoning_content``)
``response.reasoning_text.delta``..., ``response.reasoning_text.done``; for a function call
``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``;
``response.output_item.done``; and last ``response.completed`` (with the usage of the chat stream's usage chunk),
``response.incomplete`` (stopped by ``max_output_tokens``) or ``response.failed`` (an error event, or a stream
that ended before its ``finish_reason``). Every event carries its ``sequence_number``. Function calls come one
after another even when the chat stream interleaves their argument pieces (``gateway/translate/tool_calls.py``).
The item ids and the final object are those of ``gateway/translate/responses.py``, so the streamed response and
the stored one are the same.
"""

from __future__ import annotations

from gateway.translate.responses import (FINISH_TO_INCOMPLETE, ResponseContext, content_part, function_call_item,
                                         message_item, reasoning_item, response_object, usage_of)
from gateway.translate.tool_calls import ToolCallOrder
from gateway.values import ChatEvent


class ResponsesEvents:
    """The event state of one streamed response (``ctx``). ``start``, then ``feed`` per chat chunk and ``error``
    per error event, then ``finish`` once the chat stream has ended; ``final`` is the last response object."""

    def __init__(self, ctx: ResponseContext):
        self.ctx = ctx
        self.seq = 0
        self.output: list[dict] = []       # finished items, in output order
        self.open: dict | None = None      # the message or reasoning item being streamed
        self.tools = ToolCallOrder()       # the function calls, one open at a time
        self.call_item: dict | None = None   # the open function call's item
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.final: dict | None = None
        self.ended = False
        self.closing = "completed"          # the status of the items closed from now on ("incomplete": the cut)

    def _ev(self, type_: str, **fields) -> dict:
        ev = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        """``response.created`` and ``response.in_progress``."""
        r = response_object(self.ctx, "in_progress", [])
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    # -- items -------------------------------------------------------------------------------------------------
    def _open_message(self) -> list[dict]:
        """``response.output_item.added`` of a message; its content parts open with their first delta."""
        item = message_item(self.ctx, "", status="in_progress")
        n = sum(o["type"] == "message" for o in self.output)
        if n:                     # text after a call: another message, with an id of its own (the SDK checks)
            item["id"] += f"_{n}"
        item["content"] = []
        self.open = {"item": item, "text": "", "logprobs": [], "refusal": "", "parts": []}
        return [self._ev("response.output_item.added", output_index=len(self.output), item=item)]

    def _part(self, kind: str) -> tuple[int, list[dict]]:
        """The content index of the open message's ``kind`` part (``output_text`` or ``refusal``), and its
        ``response.content_part.added`` when it opens now."""
        parts = self.open["parts"]
        if kind in parts:
            return parts.index(kind), []
        parts.append(kind)
        item_id, i, k = self.open["item"]["id"], len(self.output), len(parts) - 1
        return k, [self._ev("response.content_part.added", item_id=item_id, output_index=i, content_index=k,
                            part=content_part(kind, ""))]

    def _open_reasoning(self) -> list[dict]:
        n = sum(o["type"] == "reasoning" for o in self.output)
        item = reasoning_item(self.ctx, "", n, status="in_progress")
        item["content"] = []
        self.open = {"item": item, "text": ""}
        return [self._ev("response.output_item.added", output_index=len(self.output), item=item)]

    def _close_open(self) -> list[dict]:
        """Finish the open message or reasoning item: its ``.done`` events, then it joins ``output``."""
        if self.open is None:
            return []
        item, text, i = self.open["item"], self.open["text"], len(self.output)
        if item["type"] == "message":
            done, events = self._message_done(i)
        else:
            done = {**item, "content": [{"type": "reasoning_text", "text": text}], "status": self.closing}
            events = [self._ev("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=text)]
        self.open = None
        self.output.append(done)
        return events + [self._ev("response.output_item.done", output_index=i, item=done)]

    def _message_done(self, i: int) -> tuple[dict, list[dict]]:
        """The open message (output index ``i``) finished: the item, and each content part's ``.done`` events in
        the parts' order (a message with no part has one empty ``output_text``, as ``from_chat``'s has)."""
        events = [] if self.open["parts"] else self._part("output_text")[1]
        state, item_id, content = self.open, self.open["item"]["id"], []
        for k, kind in enumerate(state["parts"]):
            if kind == "refusal":
                part = content_part(kind, state["refusal"])
                events.append(self._ev("response.refusal.done", item_id=item_id, output_index=i, content_index=k,
                                       refusal=state["refusal"]))
            else:
                part = content_part(kind, state["text"], state["logprobs"])
                events.append(self._ev("response.output_text.done", item_id=item_id, output_index=i,
                                       content_index=k, text=state["text"], logprobs=state["logprobs"]))
            events.append(self._ev("response.content_part.done", item_id=item_id, output_index=i, content_index=k,
                                   part=part))
            content.append(part)
        return {**state["item"], "status": self.closing, "content": content}, events

    def _calls(self, actions: list[tuple]) -> list[dict]:
        """The events of ``ToolCallOrder``'s actions: one function call item opened, streamed, closed."""
        events: list[dict] = []
        for action, call, *piece in actions:
            i = len(self.output)
            if action == "open":
                self.call_item = function_call_item(self.ctx, call.k, call.id, call.name, "", status="in_progress")
                events.append(self._ev("response.output_item.added", output_index=i, item=self.call_item))
            elif action == "args":
                events.append(self._ev("response.function_call_arguments.delta", item_id=self.call_item["id"],
                                       output_index=i, delta=piece[0]))
            else:
                item, self.call_item = self.call_item, None
                done = {**item, "name": call.name, "arguments": call.arguments, "status": self.closing}
                self.output.append(done)
                events += [self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                    name=call.name, arguments=call.arguments),
                           self._ev("response.output_item.done", output_index=i, item=done)]
        return events

    def _close(self) -> list[dict]:
        """Finish every open item: the message or reasoning, then the function calls in order."""
        return self._close_open() + self._calls(self.tools.flush())

    # -- input -------------------------------------------------------------------------------------------------
    def _text(self, kind: str, text: str, logprobs: list | None = None) -> list[dict]:
        """The events of a text delta of ``kind``: ``reasoning`` (a reasoning item), or the message's
        ``output_text`` or ``refusal`` content part; an item of another type open before it is finished first."""
        item_type = "reasoning" if kind == "reasoning" else "message"
        events: list[dict] = []
        if self.open is None or self.open["item"]["type"] != item_type:
            events += self._close() + (self._open_message() if item_type == "message" else self._open_reasoning())
        item_id, i = self.open["item"]["id"], len(self.output)
        if kind == "reasoning":
            self.open["text"] += text
            return events + [self._ev("response.reasoning_text.delta", item_id=item_id, output_index=i,
                                      content_index=0, delta=text)]
        k, opened = self._part(kind)
        if kind == "refusal":
            self.open["refusal"] += text
            return events + opened + [self._ev("response.refusal.delta", item_id=item_id, output_index=i,
                                               content_index=k, delta=text)]
        self.open["text"] += text
        self.open["logprobs"] += logprobs or []
        return events + opened + [self._ev("response.output_text.delta", item_id=item_id, output_index=i,
                                           content_index=k, delta=text, logprobs=logprobs or [])]

    def feed(self, chunk: ChatEvent) -> list[dict]:
        """The events of one chat stream event (its first choice; a usage event is kept for the end)."""
        if chunk.usage:
            self.usage = chunk.usage
        if not chunk.choices:
            return []
        choice = chunk.choices[0]
        events: list[dict] = []
        if choice.reasoning:
            events += self._text("reasoning", choice.reasoning)
        lps = choice.logprobs.get("content") if isinstance(choice.logprobs, dict) else None
        if choice.content or lps and not (choice.reasoning or choice.tool_calls or self.tools.count):
            # a token with no text (the end of the turn) keeps its logprob, as ``from_chat``'s message does
            events += self._text("output_text", choice.content or "", lps)
        if choice.refusal:
            events += self._text("refusal", choice.refusal)
        for call in choice.tool_calls:
            events += self._close_open() + self._calls(self.tools.feed(call))
        if choice.finish_reason:
            self.finish_reason = choice.finish_reason
        return events

    def error(self, err: dict) -> list[dict]:
        """An error event of the chat stream (a failure after content): ``response.failed``; the stream ends."""
        if self.ended:
            return []
        self.ended = True
        error = {"code": err.get("code") or err.get("type") or "server_error",
                 "message": err.get("message") or "the backend failed mid-stream"}
        self.final = response_object(self.ctx, "failed", self.output, usage_of(self.usage), error=error)
        return [self._ev("response.failed", response=self.final)]

    def finish(self) -> list[dict]:
        """The chat stream ended: close the open item and answer ``response.completed`` (``response.incomplete``
        when stopped by the token limit, the items it closes then ``incomplete``, and no empty message made up
        when it left nothing said, as ``from_chat`` answers); ``response.failed`` when no ``finish_reason``
        came."""
        if self.ended:
            return []
        if self.finish_reason is None:
            return self.error({"code": "stream_interrupted", "message": "the stream ended before the answer did"})
        self.ended = True
        incomplete = FINISH_TO_INCOMPLETE.get(self.finish_reason)
        if incomplete:           # the items still open are the ones the cut ended: OpenAI marks them incomplete
            self.closing = "incomplete"
        events = self._close()
        if not incomplete and not any(o["type"] != "reasoning" for o in self.output):
            events += self._open_message() + self._close()   # an empty answer is one empty message (from_chat's)
        self.final = response_object(self.ctx, "incomplete" if incomplete else "completed", self.output,
                                     usage_of(self.usage), incomplete=incomplete)
        kind = "response.incomplete" if incomplete else "response.completed"
        return events + [self._ev(kind, response=self.final)]
