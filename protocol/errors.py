"""Why a job failed: the domain codes an ERROR frame carries.

A worker, the broker and the frontend each report failures, and the frontend
decides what HTTP status and OpenAI error type a client sees. Before, every
producer also picked an HTTP status and sent it on the wire, so the same
failure could be shown two ways and the mapping lived in a dozen call sites.
Now producers say *what* happened, by one of the names below, and
``frontend.errors.HTTP_FORMS`` is the one table that turns a name into HTTP.

The values are the strings that travel in ``messages.Error.code`` and appear
in logs, error bodies and SSE error events; never rename one. A code this
peer does not know (from a newer peer) still decodes as a plain string, and
the frontend shows it as a server error.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    """Every failure the pool reports, by who detects it."""

    # The request cannot run; the worker refuses it before the first token.
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_PROMPT_TOKENS = "invalid_prompt_tokens"
    INVALID_MESSAGES = "invalid_messages"
    INVALID_GRAMMAR = "invalid_grammar"  # the GBNF does not compile
    UNSUPPORTED_FIELD = "unsupported_field"  # this engine cannot do it
    #: ``tools`` given, but the chat template does not render them, or
    #: teaches a call format the pool cannot read (``protocol.tool_formats``).
    TOOLS_UNSUPPORTED = "tools_unsupported"
    #: An embedding input longer than the worker's embedding batch.
    INPUT_TOO_LARGE = "input_too_large"
    # The worker ended the job.
    CLIENT_STALLED = "client_stalled"  # no credit for the stall timeout
    ENGINE_ERROR = "engine_error"  # the engine raised
    WORKER_SHUTDOWN = "worker_shutdown"  # SIGTERM's grace period ran out
    WORKER_BUSY = "worker_busy"  # the broker sent a job to a busy worker
    # The broker ended the job.
    DUPLICATE_JOB = "duplicate_job"
    INVALID_SLOT = "invalid_slot"  # ``id_slot`` names no slot in the ledger
    #: A slot action's file name, or the file itself (another model's, of
    #: another cache scope, damaged): llama-server's 400s.
    INVALID_SLOT_FILE = "invalid_slot_file"
    #: A slot save or restore on a worker without ``--slot-save-path``, or
    #: any slot action on a worker that has none (llama-server's 501).
    SLOT_ACTIONS_UNSUPPORTED = "slot_actions_unsupported"
    #: The request's ``model`` is served by no worker (OpenAI's code).
    MODEL_NOT_FOUND = "model_not_found"
    WORKER_DIED = "worker_died"
    #: A job's worker died before its first token and the worker it was
    #: retried on died too (the frontend tries a job once more, no more:
    #: ``frontend.generation``): most likely the request crashes workers.
    WORKER_CRASHED = "worker_crashed"
    WORKER_RESTARTED = "worker_restarted"
    # The worker sent a frame for the job that does not decode (a broken or
    # rogue worker): the job fails and the worker is disconnected.
    WORKER_PROTOCOL_ERROR = "worker_protocol_error"
    #: The worker showed no sign of a job it was given within
    #: ``--first-frame-timeout-s`` (a fake or wedged worker); it was dropped.
    WORKER_UNRESPONSIVE = "worker_unresponsive"
    #: A SUBMIT the broker or the worker could not decode (a peer of another
    #: version, or a frontend that lies), answered instead of dropped so its
    #: sender does not wait out a timeout.
    UNREADABLE_JOB = "unreadable_job"
    # The frontend ended the job: its link lost the broker, or no frame came.
    BROKER_UNREACHABLE = "broker_unreachable"
    BROKER_RESTARTED = "broker_restarted"
    TIMEOUT = "timeout"
    # Refusals that are no ERROR frame: the broker's NO_SLOT answer, and a
    # ledger with no worker registered yet (what ``/health`` reports).
    NO_SLOT = "no_slot"
    LOADING_MODEL = "loading_model"
    #: No worker is loaded, and the workers that tried died (restarting, or
    #: held after a crash loop): what ``/health`` reports then.
    WORKERS_FAILING = "workers_failing"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


def context_exceeded_message(n_prompt_tokens: int, n_ctx: int,
                             exact: bool = True) -> str:
    """The message of ``CONTEXT_LENGTH_EXCEEDED``, worded as llama.cpp's
    server words it, so clients that match its text keep working.

    Not ``exact``: tokenising stopped once the context was full (bounded work,
    ``workers.model.tokenizing``), so the count is a lower bound and says so.
    """
    count = f"{n_prompt_tokens}" if exact else f"at least {n_prompt_tokens}"
    return (f"request ({count} tokens) exceeds the available context size "
            f"({n_ctx} tokens), try increasing it")
