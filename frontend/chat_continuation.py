"""``add_generation_prompt`` and ``continue_final_message`` (assistant prefill),
read as llama-server reads them (``tools/server/server-common.cpp``).

* ``add_generation_prompt`` (default true): open the assistant's turn after
  the messages.
* ``continue_final_message``: true or ``"content"``: the last message, the
  assistant's, is continued, not closed (the worker renders the messages
  before it with the generation prompt, then its text). llama-server's
  ``"reasoning_content"`` (continue inside the reasoning) is refused, 400.
* Not given, with a last assistant message: it is continued all the same
  (llama-server's default ``--prefill-assistant``), and no generation
  prompt is added.

llama-server's refusals, in its words: both flags true; two assistant
messages at the end; a continued message that holds tool calls.
"""

from __future__ import annotations

from frontend.errors import BadRequest
from frontend.request_fields import RequestFields
from protocol.payloads import ChatMessage


def continuation(fields: RequestFields, chat: list[ChatMessage],
                 prefill: bool = True) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final)`` for a chat body."""
    add = fields.flag("add_generation_prompt")
    value = fields.get("continue_final_message")
    if value is None or value is False:
        wanted = False
    elif value is True or value == "content":
        wanted = True
    elif value == "reasoning_content":
        raise BadRequest("'continue_final_message': \"reasoning_content\" is not "
                         "served; continue the content (true or \"content\")",
                         param="continue_final_message")
    else:
        raise BadRequest("'continue_final_message' must be true, false or "
                         "\"content\"", param="continue_final_message")
    last_assistant = bool(chat) and chat[-1].role == "assistant"
    if not wanted and value is None and prefill and last_assistant:
        wanted, add = True, False  # llama-server's assistant prefill
    elif wanted and add is not False:
        raise BadRequest("Cannot set both add_generation_prompt and "
                         "continue_final_message to true.",
                         param="continue_final_message")
    if wanted:
        if not last_assistant:
            raise BadRequest("'continue_final_message': the last message must "
                             "be the assistant's", param="continue_final_message")
        if chat[-1].tool_calls:
            raise BadRequest("Cannot continue an assistant message that "
                             "contains tool calls.", param="messages")
    return (True if add is None else add), wanted
