"""``POST /slots/{id_slot}?action=save|restore|erase``: llama-server's slot actions.

The frontend checks what it can (the slot id, the action, the body: a
``filename`` llama.cpp's ``fs_validate_filename`` accepts, for save and
restore) and sends one SLOT_ACTION (``protocol.messages``) for the pool-wide
slot id, which names its broker as ``id_slot`` does
(``frontend.broker_pool``). That broker leases the slot (a busy one is 503
with Retry-After, at once), its worker runs the action in its own
``--slot-save-path`` (``workers.model.slot_files``) and answers; the answer
is llama-server's, with the id the client gave:

* save: ``{"id_slot", "filename", "n_saved", "n_written", "timings":
  {"save_ms"}}``;
* restore: ``{"id_slot", "filename", "n_restored", "n_read", "timings":
  {"restore_ms"}}``;
* erase: ``{"id_slot", "n_erased"}``.

Refusals have llama-server's body (``{"error": {"code": <status>, "message",
"type"}}``) and words: "Invalid slot ID", "Invalid action", "Invalid
filename" (400), its 501 for a worker without ``--slot-save-path``, and
"Unable to restore slot: ..." (400) for a file of another model, another
API key's scope, or a damaged one.

The caller's cache scope (its API key's tenant, ``frontend.cache_scope``)
travels with the action, so a save writes only that key's prompt and a
restore loads only that key's file (issue 29).
"""

from __future__ import annotations

import uuid

import falcon

from frontend.auth import presented_key
from frontend.cache_scope import CacheScope
from frontend.errors import NoSlotAvailable, PoolError
from frontend.interfaces import BrokerClient
from frontend.key_records import startup_digests
from frontend.request_body import read_json_body
from frontend.settings import FrontendSettings
from protocol import messages
from protocol.errors import ErrorCode
from protocol.records import MAX_COUNT
from protocol.slot_filename import INVALID_FILENAME, valid_filename

#: llama-server's answer field names per action: tokens, bytes, timing.
_ANSWER_FIELDS = {
    "save": ("n_saved", "n_written", "save_ms"),
    "restore": ("n_restored", "n_read", "restore_ms"),
}


class SlotActionError(PoolError):
    """A slot action refused, in llama-server's error shape (the body's
    ``code`` is the HTTP status)."""

    code_is_status = True


def _slot_id(text: str) -> int:
    """The pool-wide slot id of the path, or llama-server's 400."""
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_COUNT:
        raise SlotActionError(ErrorCode.INVALID_SLOT, "Invalid slot ID")
    return int(text)


def _filename(req: falcon.Request, action: str, limit_bytes: int) -> str:
    """The body's ``filename`` for save and restore ("" for erase, whose
    body may be empty or ``{}``); any other field is refused by name."""
    if action == "erase" and not req.content_length:
        return ""
    body = read_json_body(req, limit_bytes)
    if not isinstance(body, dict):
        raise SlotActionError(ErrorCode.INVALID_SLOT_FILE,
                              "the body must be a JSON object")
    allowed = () if action == "erase" else ("filename",)
    extra = sorted(set(body) - set(allowed))
    if extra:
        raise SlotActionError(ErrorCode.UNSUPPORTED_FIELD,
                              f"'{extra[0]}' is not a field of a slot {action}")
    if action == "erase":
        return ""
    filename = body.get("filename")
    if not isinstance(filename, str):
        raise SlotActionError(ErrorCode.INVALID_SLOT_FILE,
                              "'filename' is required (a string)")
    if not valid_filename(filename):
        raise SlotActionError(ErrorCode.INVALID_SLOT_FILE, INVALID_FILENAME)
    return filename


def answer_body(done: messages.SlotDone, id_slot: int, filename: str) -> dict:
    """llama-server's answer to a slot action that succeeded."""
    if done.action == "erase":
        return {"id_slot": id_slot, "n_erased": done.n_tokens}
    tokens, size, ms = _ANSWER_FIELDS[done.action]
    return {"id_slot": id_slot, "filename": filename, tokens: done.n_tokens,
            size: done.n_bytes, "timings": {ms: done.ms}}


class SlotActionResource:
    """``POST /slots/{id_slot}``."""

    def __init__(self, link: BrokerClient, settings: FrontendSettings) -> None:
        self.link = link
        self.settings = settings
        self.cache_scope = CacheScope(settings.cache_scope, settings.api_keys,
                                      startup_digests(settings.keys_file))

    def on_post(self, req: falcon.Request, resp: falcon.Response,
                id_slot: str) -> None:
        slot = _slot_id(id_slot)
        action = req.get_param("action") or ""
        if action not in messages.SLOT_ACTIONS:
            raise SlotActionError(ErrorCode.UNSUPPORTED_FIELD, "Invalid action")
        filename = _filename(req, action, self.settings.max_body_bytes)
        tenant = self.cache_scope.tenant(presented_key(req.get_header))
        msg = messages.SlotAction(uuid.uuid4().hex, slot, action, filename,
                                  tenant, req.context.request_id)
        stream = self.link.slot_action(msg)
        try:
            # One answer, after the action itself: a worker that never
            # answers is dropped by its broker (its first-frame deadline),
            # which then says so.
            answer = stream.get(self.settings.frame_timeout_s)
        finally:
            self.link.forget(msg.job_id)
        resp.media = answer_body(_done(answer), slot, filename)


def _done(answer: messages.Message | None) -> messages.SlotDone:
    """The worker's SLOT_DONE, or the refusal it is not, raised."""
    if isinstance(answer, messages.SlotDone):
        if answer.code:
            raise SlotActionError(answer.code, answer.message)
        return answer
    if isinstance(answer, messages.NoSlot):
        raise NoSlotAvailable(answer.retry_after_s)
    if isinstance(answer, messages.Error):
        raise SlotActionError(answer.code, answer.message)
    raise SlotActionError(ErrorCode.TIMEOUT, "the slot action got no answer")


def add_slot_action_routes(app: falcon.App, link: BrokerClient,
                           settings: FrontendSettings) -> None:
    app.add_route("/slots/{id_slot}", SlotActionResource(link, settings))
