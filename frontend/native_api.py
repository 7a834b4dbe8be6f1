"""llama.cpp's native endpoints: ``/completion``, ``/infill``, ``/tokenize``,
``/detokenize``, ``/apply-template`` and ``/props``.

Who answers:

* ``/completion`` and ``/infill`` are generation jobs like the OpenAI ones:
  they take a slot, through the same request pipeline
  (``frontend.endpoint``), ``start_job`` and lease.
* ``/tokenize``, ``/detokenize`` and ``/apply-template`` are answered here,
  from the vocabulary the frontend loads anyway to count prompt tokens
  (``frontend.prompt_gate``, the frontend's ``--model``). They take no slot
  and no worker's time, and they use the very code the workers use
  (``workers.model.prompting.PromptBuilder``), so a token count or a
  rendered template is the one a generation will see. A frontend started
  without the model file answers them 501 naming the setting, rather than
  sending tokenizer work to a worker between jobs.
* ``/props`` combines that vocabulary with the broker's ledger (pool-wide
  ``total_slots``). ``POST /props`` is refused as llama.cpp refuses it
  without ``--props``: the pool has no global property to change at run time.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from collections.abc import Callable
from typing import Any

import falcon

from frontend import model_code, openai_schema
from frontend.endpoint import GenerationEndpoint, Submission
from frontend.errors import ApiError, BadRequest, ContextSizeExceeded
from frontend.interfaces import BrokerClient
from frontend.job import Job
from frontend.model_resolution import ModelNotFound, catalog, resolve_in
from frontend.native_format import NativeShaper, sampler_params
from frontend.native_schema import (
    NativeRequest,
    PromptPart,
    parse_completion,
    parse_detokenize,
    parse_infill_input,
    parse_tokenize,
)
from frontend.prompt_gate import PromptGate
from frontend.request_body import read_json_body
from frontend.settings import FrontendSettings
from protocol.payloads import Sampling


class NotSupported(ApiError):
    """llama.cpp's 501 (``ERROR_TYPE_NOT_SUPPORTED``)."""

    status = 501
    type = "not_supported_error"
    code = 501
    reject_reason = "not_supported"


#: Why a frontend without the vocabulary cannot answer.
NO_VOCAB = ("this frontend has no model file to read the vocabulary from: start "
            "it with --model PATH (LLAMAPOOL_TOKENIZER_MODEL)")


def _builder(gate: PromptGate | None):
    if gate is None:
        raise NotSupported(NO_VOCAB)
    return gate.builder()



def tokenize_parts(builder, parts: str | list[PromptPart], *, add_special: bool,
                   parse_special: bool, limit: int, where: str,
                   too_long: Callable[[Any, str], ApiError] = model_code.prompt_too_long
                   ) -> list[int]:
    """llama.cpp's ``tokenize_mixed``: texts are tokenised in place, ids kept;
    only a text at the very start gets the BOS. ``limit`` tokens or more:
    the error ``too_long(PromptTooLong, where)`` gives."""
    if isinstance(parts, str):
        parts = [parts]
    tokens: list[int] = []
    for i, part in enumerate(parts):
        if not isinstance(part, str):
            tokens.append(part)
            continue
        # What is left of the limit: many texts together stop at it too.
        before = len(tokens)
        try:
            tokens += builder.tokenize_text(
                part, add_special=add_special and i == 0,
                parse_special=parse_special, limit=limit - before)
        except model_code.PromptTooLong as exc:
            whole = model_code.PromptTooLong(
                before + exc.at_least, limit, exc.exact and i == len(parts) - 1)
            raise too_long(whole, where) from None
    bad = next((t for t in tokens if not builder.valid_token(t)), None)
    if bad is not None:
        raise BadRequest(f"'{where}': token {bad} is out of the vocabulary",
                         param=where)
    return tokens


class NativeCompletionResource(GenerationEndpoint[NativeRequest]):
    """``POST /completion`` and ``POST /infill``."""

    def __init__(self, link: BrokerClient, settings: FrontendSettings,
                 gate: PromptGate | None, infill: bool = False) -> None:
        super().__init__(link, settings, gate)
        self.infill = infill

    def _settle_prompt(self, parsed: NativeRequest, body: dict
                       ) -> tuple[NativeRequest, int, str]:
        """The request with its prompt in the form the worker takes, the
        prompt's token count (0: the worker counts) and its text."""
        n_ctx = self.settings.n_ctx
        generation = parsed.generation
        # None for another model than the gate's: its worker counts.
        gate = self.door_gate(generation)
        prompt = parsed.prompt
        if self.infill:
            tokens = self._infill_tokens(parsed, body, gate)
        elif isinstance(prompt, str):
            if gate is None:
                generation = dataclasses.replace(generation, prompt=prompt)
                return dataclasses.replace(parsed, generation=generation), 0, prompt
            generation = gate.check(dataclasses.replace(generation,
                                                        prompt=prompt))
            return (dataclasses.replace(parsed, generation=generation),
                    len(generation.prompt_tokens), prompt)
        elif all(isinstance(p, int) for p in prompt):
            # Token ids alone need no vocabulary here: the worker checks
            # their range, and refuses a prompt that fills its context.
            tokens = list(prompt)
            if not tokens:
                raise BadRequest("'prompt' is an empty list", param="prompt")
        else:
            tokens = tokenize_parts(_builder(gate), prompt, add_special=True,
                                    parse_special=True, limit=n_ctx, where="prompt")
        if len(tokens) >= n_ctx:
            raise model_code.context_exceeded(len(tokens), n_ctx, "prompt")
        text = ""
        if gate is not None:
            builder = gate.builder()
            pieces = builder.pieces([t for t in tokens if builder.valid_token(t)])
            text = b"".join(pieces).decode("utf-8", "replace")
        generation = dataclasses.replace(generation, prompt_tokens=tokens)
        return dataclasses.replace(parsed, generation=generation), len(tokens), text

    def _infill_tokens(self, parsed: NativeRequest, body: dict,
                       gate: PromptGate | None) -> list[int]:
        builder = _builder(gate)
        problem = model_code.fim_problem(builder)
        if problem is not None:
            # llama.cpp's words, checked before the infill fields as there; it
            # answers 501, the pool 400 (issue 11): the server implements
            # infill, this model cannot do it.
            raise BadRequest(problem, param="model", code="infill_not_supported")
        given = parse_infill_input(body)
        if not isinstance(parsed.prompt, str):
            raise BadRequest('"prompt" must be a string', param="prompt")
        try:
            return model_code.infill_tokens(
                builder, given.prefix, given.suffix, parsed.prompt,
                [model_code.ExtraChunk(text, name) for text, name in given.extra],
                limit=self.settings.n_ctx)
        except model_code.NoFimTokens as exc:
            raise BadRequest(str(exc), param="model",
                             code="infill_not_supported") from None
        except model_code.PromptTooLong as exc:
            raise model_code.prompt_too_long(exc, "input_prefix") from None

    def parse(self, body: Any) -> NativeRequest:
        parsed = parse_completion(body, infill=self.infill)
        return parsed

    def admit(self, parsed: NativeRequest, body: Any
              ) -> Submission[NativeRequest]:
        parsed, n_prompt, prompt_text = self._settle_prompt(parsed, body)
        return Submission(parsed, parsed.generation, stream=parsed.stream,
                          id_slot=parsed.id_slot, n_prompt=n_prompt,
                          prompt_text=prompt_text)

    def shaper(self, req: falcon.Request, submission: Submission[NativeRequest],
               job: Job) -> NativeShaper:
        parsed = submission.parsed
        return NativeShaper(
            generation=submission.generation,
            model=self.model_name(job, parsed.model),
            id_slot=job.slot_id if job.slot_id is not None else -1,
            n_prompt=submission.n_prompt, prompt_text=submission.prompt_text,
            n_probs=parsed.n_probs, show_probs=parsed.show_probs,
            return_tokens=parsed.return_tokens, stream=parsed.stream,
            response_fields=parsed.response_fields)


class TokenizeResource:
    """``POST /tokenize``: ``{"tokens": [...]}``, ids or ``{id, piece}``."""

    def __init__(self, settings: FrontendSettings, gate: PromptGate | None) -> None:
        self.settings = settings
        self.gate = gate

    def on_post(self, req, resp) -> None:
        body = read_json_body(req, self.settings.max_body_bytes)
        parsed = parse_tokenize(body)
        builder = _builder(self.gate)
        # Bounded as a prompt is (issue 29): at most a context of tokens, so
        # a text is refused by its size before any tokenising, or as soon as
        # its pieces fill the context. Bounded by the body alone (1 MiB of
        # byte-fallback text), one call took a core for a minute.
        tokens = tokenize_parts(builder, parsed.content,
                                add_special=parsed.add_special,
                                parse_special=parsed.parse_special,
                                limit=self.settings.n_ctx + 1, where="content",
                                too_long=self._too_long)
        if not parsed.with_pieces:
            resp.media = {"tokens": tokens}
            return
        out = []
        for token, piece in zip(tokens, builder.pieces(tokens), strict=True):
            try:
                shown: str | list[int] = piece.decode("utf-8")
            except UnicodeDecodeError:
                shown = list(piece)  # part of a character: its bytes, as llama.cpp
            out.append({"id": token, "piece": shown})
        resp.media = {"tokens": out}

    def _too_long(self, exc, where: str) -> ContextSizeExceeded:
        n_ctx = self.settings.n_ctx
        count = exc.at_least if exc.exact else f"at least {exc.at_least}"
        return ContextSizeExceeded(
            f"'{where}' is {count} tokens; /tokenize counts at most {n_ctx}, "
            "the context size (--ctx)", exc.at_least, n_ctx, param=where)


class DetokenizeResource:
    """``POST /detokenize``: ``{"content": "..."}``."""

    def __init__(self, settings: FrontendSettings, gate: PromptGate | None) -> None:
        self.settings = settings
        self.gate = gate

    def on_post(self, req, resp) -> None:
        tokens = parse_detokenize(read_json_body(req, self.settings.max_body_bytes))
        builder = _builder(self.gate)
        bad = next((t for t in tokens if not builder.valid_token(t)), None)
        if bad is not None:
            raise BadRequest(f"'tokens': token {bad} is out of the vocabulary",
                             param="tokens")
        text = b"".join(builder.pieces(tokens)).decode("utf-8", "replace")
        resp.media = {"content": text}


class ApplyTemplateResource:
    """``POST /apply-template``: ``{"prompt": ...}``, the chat prompt the chat
    endpoint would generate from, rendered by the same code."""

    def __init__(self, settings: FrontendSettings, gate: PromptGate | None) -> None:
        self.settings = settings
        self.gate = gate

    def on_post(self, req, resp) -> None:
        body = read_json_body(req, self.settings.max_body_bytes)
        # The whole chat body is checked as the chat endpoint checks it.
        parsed = openai_schema.parse_chat(body)
        builder = _builder(self.gate)
        generation = parsed.generation
        try:
            # With the tools, as the chat endpoint renders them (and refuses
            # them for a template that cannot).
            rendered = builder.render_chat(
                generation.messages, generation.tools,
                generation.chat_template_kwargs,
                add_generation_prompt=generation.add_generation_prompt,
                continue_final=generation.continue_final)
        except model_code.ToolsUnsupported as exc:
            raise BadRequest(str(exc), param="tools") from None
        except model_code.PromptError as exc:
            raise BadRequest(f"cannot render messages: {exc}",
                             param="messages") from None
        resp.media = {"prompt": rendered.prompt}


def build_info() -> str:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"
    return (f"llamapool {version('llamapool')}, "
            f"llama-cpp-python {version('llama_cpp_python')}")


class PropsResource:
    """``GET /props`` (public fields of the pool) and ``POST /props`` (refused)."""

    def __init__(self, link: BrokerClient, settings: FrontendSettings,
                 gate: PromptGate | None) -> None:
        self.link = link
        self.settings = settings
        self.gate = gate

    def on_get(self, req, resp) -> None:
        s = self.settings
        status = self.link.status(s.health_timeout_s, s.health_cache_s)
        slots = status.slots if status is not None else []
        total = status.slots_total if status is not None else None
        asked = req.get_param("model")
        if asked:
            # llama-server's router: one model's props (issue 30).
            model = resolve_in(catalog(status), asked)
            if model is None:
                raise ModelNotFound(asked)
            slots = [slot for slot in slots if slot.model == model]
            total = sum(1 for slot in slots if slot.state not in ("loading",
                                                                  "failed"))
        n_ctx = slots[0].n_ctx if slots else s.n_ctx
        template = bos = eos = ""
        if self.gate is not None:
            builder = self.gate.builder()
            template = builder.llama.metadata.get("tokenizer.chat_template", "")
            bos = builder.special_text(builder.llama.token_bos())
            eos = builder.special_text(builder.llama.token_eos())
        resp.media = {
            "default_generation_settings": {
                "params": sampler_params(Sampling(), None, stream=False, n_probs=0),
                "n_ctx": n_ctx,
            },
            # Pool-wide, from the broker's ledger (None: broker unreachable).
            "total_slots": total,
            "model_alias": slots[0].model if slots else s.model_name,
            # The file's name only: its directory says nothing a client
            # needs, and tells any reader (a web page, before issue 29)
            # about the host's file system.
            "model_path": os.path.basename(s.tokenizer_model),
            "modalities": {"vision": False, "audio": False, "video": False},
            "endpoint_slots": True,
            "endpoint_props": False,
            "endpoint_metrics": True,
            "chat_template": template,
            "bos_token": bos,
            "eos_token": eos,
            "build_info": build_info(),
            "is_sleeping": False,
        }

    def on_post(self, req, resp) -> None:
        # llama.cpp's words, without its advice: the pool has no ``--props``,
        # because it has no global property to change at run time.
        raise NotSupported("This server does not support changing global "
                           "properties")


def add_native_routes(app: falcon.App, link: BrokerClient,
                      settings: FrontendSettings, gate: PromptGate | None) -> None:
    """Route llama.cpp's native endpoints. ``/completions`` (plural) stays
    OpenAI's (``frontend.app``): see docs/llama-cpp-compatibility.md."""
    app.add_route("/completion", NativeCompletionResource(link, settings, gate))
    app.add_route("/infill", NativeCompletionResource(link, settings, gate,
                                                      infill=True))
    app.add_route("/tokenize", TokenizeResource(settings, gate))
    app.add_route("/detokenize", DetokenizeResource(settings, gate))
    app.add_route("/apply-template", ApplyTemplateResource(settings, gate))
    app.add_route("/props", PropsResource(link, settings, gate))
