"""llama.cpp's native endpoints: ``/completion``, ``/infill``, ``/tokenize``,
``/detokenize``, ``/apply-template`` and ``/props``.

Who answers:

* ``/completion`` and ``/infill`` are generation jobs like the OpenAI ones:
  they take a slot, through the same request pipeline
  (``frontend.endpoint``), ``start_job_steps`` and lease.
* ``/tokenize``, ``/detokenize`` and ``/apply-template`` are answered here,
  from the vocabulary the frontend loads anyway to count prompt tokens
  (``frontend.prompt_gate``, the frontend's ``--model``, or ``--models``
  with one per model: ``frontend.vocabularies``). They take no slot and no
  worker's time, and they use the very code the workers use
  (``workers.model.prompting.PromptBuilder``), so a token count or a
  rendered template is the one a generation will see. Their ``model`` is
  resolved as a generation's is (``frontend.model_resolution``: by name or
  alias, 404 for a name nobody serves, 400 when several models are served
  and none is named), and its vocabulary and template answer. A frontend
  without that model's file answers them 501 naming the setting, rather
  than sending tokenizer work to a worker between jobs.
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
from frontend.model_resolution import (
    ModelNotFound,
    ModelResolver,
    catalog,
    resolve_in,
)
from frontend.native_format import NativeShaper, default_params
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
from frontend.vocabularies import Vocabularies


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


class VocabularyResource:
    """Base of the endpoints a model's vocabulary answers: the body's
    ``model``, resolved, to its prompt gate (the module's rules)."""

    def __init__(self, link: BrokerClient, settings: FrontendSettings,
                 vocabs: Vocabularies) -> None:
        self.settings = settings
        self.vocabs = vocabs
        self.models = ModelResolver(link, settings)

    def gate_of(self, asked: str | None) -> PromptGate:
        """The gate of the model ``asked`` names.

        Raises:
            ModelNotFound, Unavailable (loading), BadRequest (several models,
            none named): as a generation's ``model``; NotSupported: this
            frontend has no vocabulary of that model.
        """
        model = self.models.resolve(asked)
        gate = (self.vocabs.gate_for(model, self.models.seen) if self.vocabs
                else None)
        if gate is None:
            raise NotSupported(NO_VOCAB if not self.vocabs or not model else (
                f"this frontend has no model file of model '{model}' to read "
                "its vocabulary from: add it to --models FILE "
                "(LLAMAPOOL_MODELS_FILE)"))
        return gate



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
                 vocabs: Vocabularies, infill: bool = False) -> None:
        super().__init__(link, settings, vocabs)
        self.infill = infill

    def _settle_prompt(self, parsed: NativeRequest, body: dict
                       ) -> tuple[NativeRequest, int, str]:
        """The request with its prompt in the form the worker takes, the
        prompt's token count (0: the worker counts) and its text."""
        generation = parsed.generation
        # None for a model this frontend has no vocabulary of: its worker
        # counts.
        gate = self.door_gate(generation)
        n_ctx = gate.n_ctx if gate is not None else self.settings.n_ctx
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
                limit=gate.n_ctx)
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
            # As the worker ran it: its defaults for what the client left out.
            generation=(job.defaults.fill(submission.generation)
                        if job.defaults else submission.generation),
            model=self.model_name(job, parsed.model),
            id_slot=job.slot_id if job.slot_id is not None else -1,
            n_prompt=submission.n_prompt, prompt_text=submission.prompt_text,
            n_probs=parsed.n_probs, show_probs=parsed.show_probs,
            return_tokens=parsed.return_tokens, stream=parsed.stream,
            response_fields=parsed.response_fields)


class TokenizeResource(VocabularyResource):
    """``POST /tokenize``: ``{"tokens": [...]}``, ids or ``{id, piece}``."""

    def on_post(self, req, resp) -> None:
        body = read_json_body(req, self.settings.max_body_bytes)
        parsed = parse_tokenize(body)
        gate = self.gate_of(parsed.model)
        builder = gate.builder()
        # Bounded as a prompt is (issue 29): at most a context of tokens, so
        # a text is refused by its size before any tokenising, or as soon as
        # its pieces fill the context. Bounded by the body alone (1 MiB of
        # byte-fallback text), one call took a core for a minute.
        tokens = tokenize_parts(builder, parsed.content,
                                add_special=parsed.add_special,
                                parse_special=parsed.parse_special,
                                limit=gate.n_ctx + 1, where="content",
                                too_long=lambda exc, where: self._too_long(
                                    exc, where, gate.n_ctx))
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

    @staticmethod
    def _too_long(exc, where: str, n_ctx: int) -> ContextSizeExceeded:
        count = exc.at_least if exc.exact else f"at least {exc.at_least}"
        return ContextSizeExceeded(
            f"'{where}' is {count} tokens; /tokenize counts at most {n_ctx}, "
            "the context size (--ctx)", exc.at_least, n_ctx, param=where)


class DetokenizeResource(VocabularyResource):
    """``POST /detokenize``: ``{"content": "..."}``."""

    def on_post(self, req, resp) -> None:
        parsed = parse_detokenize(read_json_body(req, self.settings.max_body_bytes))
        tokens = parsed.tokens
        builder = self.gate_of(parsed.model).builder()
        bad = next((t for t in tokens if not builder.valid_token(t)), None)
        if bad is not None:
            raise BadRequest(f"'tokens': token {bad} is out of the vocabulary",
                             param="tokens")
        text = b"".join(builder.pieces(tokens)).decode("utf-8", "replace")
        resp.media = {"content": text}


class ApplyTemplateResource(VocabularyResource):
    """``POST /apply-template``: ``{"prompt": ...}``, the chat prompt the chat
    endpoint would generate from, rendered by the same code (the named
    model's template)."""

    def on_post(self, req, resp) -> None:
        body = read_json_body(req, self.settings.max_body_bytes)
        # The whole chat body is checked as the chat endpoint checks it.
        parsed = openai_schema.parse_chat(body)
        builder = self.gate_of(parsed.model).builder()
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
                 vocabs: Vocabularies) -> None:
        self.link = link
        self.settings = settings
        self.vocabs = vocabs

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
        # The vocabulary of the model asked for (or of the one model).
        gate = self.vocabs.gate_for(slots[0].model if asked and slots else "",
                                    catalog(status)) if self.vocabs else None
        if gate is not None:
            builder = gate.builder()
            template = builder.llama.metadata.get("tokenizer.chat_template", "")
            bos = builder.special_text(builder.llama.token_bos())
            eos = builder.special_text(builder.llama.token_eos())
        resp.media = {
            "default_generation_settings": {
                # The model's workers' own defaults where they have some.
                "params": default_params(next(
                    (slot.defaults for slot in slots if slot.defaults
                     and slot.state not in ("loading", "failed")), None)),
                "n_ctx": n_ctx,
            },
            # Pool-wide, from the broker's ledger (None: broker unreachable).
            "total_slots": total,
            "model_alias": slots[0].model if slots else s.model_name,
            # The file's name only: its directory says nothing a client
            # needs, and tells any reader (a web page, before issue 29)
            # about the host's file system.
            "model_path": os.path.basename(gate.model_path) if gate else "",
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
                      settings: FrontendSettings, vocabs: Vocabularies) -> None:
    """Route llama.cpp's native endpoints. ``/completions`` (plural) stays
    OpenAI's (``frontend.app``): see docs/llama-cpp-compatibility.md."""
    app.add_route("/completion", NativeCompletionResource(link, settings, vocabs))
    app.add_route("/infill", NativeCompletionResource(link, settings, vocabs,
                                                      infill=True))
    app.add_route("/tokenize", TokenizeResource(link, settings, vocabs))
    app.add_route("/detokenize", DetokenizeResource(link, settings, vocabs))
    app.add_route("/apply-template", ApplyTemplateResource(link, settings, vocabs))
    app.add_route("/props", PropsResource(link, settings, vocabs))
