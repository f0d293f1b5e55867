"""Stored responses, for the Responses API's ``store``, ``previous_response_id``, and
``GET`` / ``DELETE /v1/responses/{id}``.

A server started with ``--responses-store N`` keeps the last ``N`` finished responses that were
not created with ``store: false`` (OpenAI's default is to store), each with the conversation it
ended: the input it was given (an earlier response's conversation first, where it continued
one) and its own output, as chat messages. A request naming ``previous_response_id`` continues
that conversation, as OpenAI's API does: the earlier input and output come before its own input,
and its ``instructions`` replace the earlier ones. The store lives in the server's memory: it
is bounded, the oldest response going first, and empty after a restart. Without it, ``store``
is answered ``false`` and ``previous_response_id`` is refused with a 400 that says how to
start the server.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.serving.errors import APIError
from specdec.serving.protocol import ChatMessage

if TYPE_CHECKING:
    from specdec.serving.responses_render import ResponseObject


@dataclass(slots=True)
class StoredResponse:
    response: ResponseObject  # as it was given back
    conversation: list[ChatMessage]  # its input (continued ones' first), then its output


class ResponseStore:
    """The last ``capacity`` stored responses, by id."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response: ResponseObject, conversation: list[ChatMessage]) -> None:
        self._responses[response.id] = StoredResponse(response, conversation)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; 404 naming ``param`` where there is none of that id."""
        stored = self._responses.get(response_id)
        if stored is None:
            raise APIError(
                404,
                f"Response with id '{response_id}' not found (this server keeps the last "
                f"{self.capacity} stored responses, in memory)",
                param=param,
                code="response_not_found",
            )
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._responses[response_id]


def output_messages(response: ResponseObject) -> list[ChatMessage]:
    """A finished response's output as chat messages: its text as the assistant's, its function
    calls as an assistant message's calls (its thinking is not carried, as chat templates drop
    earlier turns' thinking)."""
    messages = []
    for item in response.output:
        if item.type == "message":
            text = "".join(part.text for part in item.content)
            messages.append(ChatMessage(role="assistant", content=text))
        elif item.type == "function_call":
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            messages.append(ChatMessage(role="assistant", tool_calls=[call]))
    return messages
