"""The frontend's settings: one frozen object, built from ``LLAMAPOOL_*``.

gunicorn forks the app, so the CLI (``llamapool frontend``) passes its flags
to the workers as environment variables and ``llamapool.wsgi`` reads them here.
Every default is documented in this one place.

| variable                       | default        | meaning                           |
|--------------------------------|----------------|-----------------------------------|
| LLAMAPOOL_BROKER               | (required)     | broker frontends endpoint(s)      |
| LLAMAPOOL_API_KEYS             | (none)         | comma-separated keys              |
| LLAMAPOOL_API_KEY_FILE         | (none)         | file with one key per line        |
| LLAMAPOOL_KEYS_FILE            | (none)         | named keys, hashes, limits        |
| LLAMAPOOL_MAX_BODY_BYTES       | 1048576        | larger bodies get 413             |
| LLAMAPOOL_SUBMIT_TIMEOUT_S     | 5.0            | wait for the broker's answer      |
| LLAMAPOOL_FRAME_TIMEOUT_S      | 600.0          | longest silence mid-job           |
| LLAMAPOOL_HEALTH_TIMEOUT_S     | 1.0            | /health never blocks longer       |
| LLAMAPOOL_HEALTH_CACHE_S       | 0.25           | /health may be this stale         |
| LLAMAPOOL_HEARTBEAT_INTERVAL_S | 1.0            | heartbeat to the broker           |
| LLAMAPOOL_HEARTBEAT_LIVENESS   | 3              | missed beats = broker lost        |
| LLAMAPOOL_MODEL_NAME           | (from workers) | name when no worker is known      |
| LLAMAPOOL_DEFAULT_MODEL        | (the only one) | model of requests naming none     |
| LLAMAPOOL_CREDIT_BATCH_FRAMES  | 64             | frames read per credit return     |
| LLAMAPOOL_MERGE_WAITING_FRAMES | 1              | waiting frames sent as one event  |
| LLAMAPOOL_TOKENIZER_MODEL      | (none)         | GGUF to count prompt tokens       |
| LLAMAPOOL_MODELS_FILE          | (none)         | GGUFs to count, one per model     |
| LLAMAPOOL_CHAT_FORMAT          | (template)     | same as the workers' format       |
| LLAMAPOOL_CHAT_TEMPLATE        | (none)         | llama.cpp template name, or Jinja |
| LLAMAPOOL_CHAT_TEMPLATE_FILE   | (none)         | Jinja chat template file          |
| LLAMAPOOL_CTX                  | 2048           | workers' context size             |
| LLAMAPOOL_STREAM_SNDBUF_BYTES  | 65536          | kernel buffer per SSE stream      |
| LLAMAPOOL_HEADER_TIMEOUT_S     | 10.0           | request head must arrive by       |
| LLAMAPOOL_BODY_TIMEOUT_S       | 30.0           | then the body must arrive by      |
| LLAMAPOOL_SEND_TIMEOUT_S       | 30.0           | client reads nothing: closed      |
| LLAMAPOOL_MAX_PENDING_CONNS    | 1000           | arriving requests per process     |
| LLAMAPOOL_CURVE_SERVER_KEY     | (none)         | broker's public .key (CURVE)      |
| LLAMAPOOL_CURVE_SECRET_KEY     | (none)         | own .key_secret (CURVE)           |
| LLAMAPOOL_CORS_ORIGINS         | (* with keys)  | web origins allowed (CORS)        |
| LLAMAPOOL_CORS_METHODS         | (the route's)  | CORS methods (preflight)          |
| LLAMAPOOL_CORS_HEADERS         | (as asked)     | CORS headers (preflight)          |
| LLAMAPOOL_CORS_CREDENTIALS     | off            | CORS: allow credentials           |
| LLAMAPOOL_ALLOWED_HOSTS        | (local, IPs)   | Host names served; 421 else       |
| LLAMAPOOL_CACHE_SCOPE          | key            | prompt reuse: per key or pool     |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from frontend import cache_scope as cache_scope_module
from protocol import defaults, timing
from protocol.broker_list import split_endpoints
from protocol.chat_choice import (
    chat_choice,
    chat_template_file_setting,
    chat_template_setting,
    checked_chat_choice,
)
from protocol.settings import (
    ConfigError,
    comma_list,
    load,
    positive_float,
    positive_int,
    setting,
)

__all__ = ["ConfigError", "FrontendSettings", "read_key_file"]


def read_key_file(path: str) -> list[str]:
    """Keys from a file, one per line; blank lines and ``#`` comments skipped."""
    with open(path, encoding="utf-8") as f:
        lines = (line.strip() for line in f)
        return [line for line in lines if line and not line.startswith("#")]


@dataclasses.dataclass(frozen=True)
class FrontendSettings:
    broker_endpoint: str = setting(
        dataclasses.MISSING, "LLAMAPOOL_BROKER",
        "broker frontends endpoint(s)",
        flag="--broker", repeat=True,
        help="broker frontends endpoint; repeat (or a comma list) to use "
             "several brokers at once")
    api_keys: tuple[str, ...] = setting(
        (), "LLAMAPOOL_API_KEYS", "comma-separated keys",
        flag="--api-key", repeat=True, help="accepted API key (repeatable)")
    api_key_file: str = setting(
        "", "LLAMAPOOL_API_KEY_FILE", "file with one key per line",
        flag="--api-key-file")
    keys_file: str = setting(
        "", "LLAMAPOOL_KEYS_FILE", "named keys, hashes, limits",
        flag="--keys-file",
        help="TOML keys file: a name, the SHA-256 and optional limits per key "
             "(docs/api.md); read again when it changes")
    max_body_bytes: int = setting(
        1024 * 1024, "LLAMAPOOL_MAX_BODY_BYTES", "larger bodies get 413")
    submit_timeout_s: float = setting(
        timing.SUBMIT_TIMEOUT_S, "LLAMAPOOL_SUBMIT_TIMEOUT_S",
        "wait for the broker's answer")
    frame_timeout_s: float = setting(
        600.0, "LLAMAPOOL_FRAME_TIMEOUT_S", "longest silence mid-job")
    health_timeout_s: float = setting(
        1.0, "LLAMAPOOL_HEALTH_TIMEOUT_S", "/health never blocks longer")
    #: /health and /v1/models may answer from a ledger this fresh, so a flood
    #: of unauthenticated checks costs the broker a few STATUS a second.
    health_cache_s: float = setting(
        0.25, "LLAMAPOOL_HEALTH_CACHE_S", "/health may be this stale")
    heartbeat_interval_s: float = setting(
        timing.HEARTBEAT_INTERVAL_S, "LLAMAPOOL_HEARTBEAT_INTERVAL_S",
        "heartbeat to the broker",
        flag="--heartbeat-interval-s", parse=positive_float)
    heartbeat_liveness: int = setting(
        timing.HEARTBEAT_LIVENESS, "LLAMAPOOL_HEARTBEAT_LIVENESS",
        "missed beats = broker lost",
        flag="--heartbeat-liveness", parse=positive_int)
    #: Also the pool's name for the ``--model`` file's model (besides the
    #: file's own name): in a pool of several models the prompt gate counts
    #: only for it (``frontend.model_resolution``).
    model_name: str = setting(
        "", "LLAMAPOOL_MODEL_NAME", "name when no worker is known",
        shown="(from workers)")
    #: The model a request that names none goes to, in a pool of several
    #: (``frontend.model_resolution``); "": the only model.
    default_model: str = setting(
        "", "LLAMAPOOL_DEFAULT_MODEL", "model of requests naming none",
        shown="(the only one)", flag="--default-model",
        help="the model (name or alias) a request without 'model' gets when "
             "the pool serves several (default: the only model)")
    #: Frames the client consumes before the frontend returns credit.
    credit_batch_frames: int = setting(
        timing.CREDIT_WINDOW_FRAMES // 4, "LLAMAPOOL_CREDIT_BATCH_FRAMES",
        "frames read per credit return")
    #: TOKEN frames already waiting for a client that is behind, sent as
    #: one event (``frontend.frame_merge``); 1, the default: one event per
    #: frame. Off by default until on has been through CI: merged events
    #: are denser, so where the model outpaces the frontend a client that
    #: stops reading takes more tokens into the socket buffers before its
    #: worker pauses for credit (docs/operations.md, flow control).
    merge_waiting_frames: int = setting(
        1, "LLAMAPOOL_MERGE_WAITING_FRAMES", "waiting frames sent as one event",
        flag="--merge-waiting-frames", parse=positive_int,
        help="a stream whose client is behind gets up to N of the token "
             "frames waiting for it as one event (a client on a slow link "
             "catches up; where the model outpaces the frontend, one that "
             "stops reading takes more tokens before its worker pauses); a "
             "client that keeps up gets each token as it comes. 1 "
             "(default): one event per frame")
    tokenizer_model: str = setting(
        "", "LLAMAPOOL_TOKENIZER_MODEL", "GGUF to count prompt tokens",
        flag="--model",
        help="GGUF to count prompt tokens at the door (vocab only)")
    #: A pool of several models: ``up --models``'s file, whose tables give
    #: each model's GGUF (vocabulary only), aliases, ``ctx`` and
    #: ``chat_format``; the frontend counts prompts and answers /tokenize,
    #: /detokenize and /apply-template per model (``frontend.vocabularies``).
    models_file: str = setting(
        "", "LLAMAPOOL_MODELS_FILE", "GGUFs to count, one per model",
        flag="--models",
        help="the models file (TOML, as 'llamapool up --models'): each "
             "model's vocabulary is loaded to count its prompt tokens and "
             "answer /tokenize, /detokenize, /apply-template (instead of "
             "--model)")
    chat_format: str | None = setting(
        None, "LLAMAPOOL_CHAT_FORMAT", "same as the workers' format",
        shown="(template)",
        flag="--chat-format",
        help="named chat format (e.g. gemma), or 'template' for the GGUF's "
             "Jinja template (default: template if present)")
    chat_template: str = chat_template_setting()
    chat_template_file: str = chat_template_file_setting()
    n_ctx: int = setting(defaults.N_CTX, "LLAMAPOOL_CTX", "workers' context size",
        flag="--ctx", parse=positive_int)
    stream_sndbuf_bytes: int = setting(
        65536, "LLAMAPOOL_STREAM_SNDBUF_BYTES", "kernel buffer per SSE stream")
    #: Deadlines on the client's side of a request (``llamapool.http_worker``):
    #: a request's head and then its body must arrive in time, or the
    #: connection gets 408; it holds no thread meanwhile, and at most
    #: ``max_pending_connections`` per process may be arriving (the oldest
    #: is closed beyond). A response write the client does not take for
    #: ``send_timeout_s`` ends the response (a stream's job is cancelled).
    header_timeout_s: float = setting(
        10.0, "LLAMAPOOL_HEADER_TIMEOUT_S", "request head must arrive by")
    body_timeout_s: float = setting(
        30.0, "LLAMAPOOL_BODY_TIMEOUT_S", "then the body must arrive by")
    send_timeout_s: float = setting(
        30.0, "LLAMAPOOL_SEND_TIMEOUT_S", "client reads nothing: closed")
    max_pending_connections: int = setting(
        1000, "LLAMAPOOL_MAX_PENDING_CONNS", "arriving requests per process")
    #: CURVE key files for the broker link (``protocol.curve``); empty: plaintext.
    curve_server_key: str = setting(
        "", "LLAMAPOOL_CURVE_SERVER_KEY", "broker's public .key (CURVE)",
        flag="--curve-server-key")
    curve_secret_key: str = setting(
        "", "LLAMAPOOL_CURVE_SECRET_KEY", "own .key_secret (CURVE)",
        flag="--curve-secret-key")
    #: Web pages on these origins may call the API (comma-separated, e.g.
    #: ``https://app.example.com``); ``*`` allows any. Not given: any origin
    #: when keys are set (llama.cpp's default, ``*``), none without a key,
    #: so that no web page can use a keyless pool (``frontend.cors``). A
    #: browser still needs a key where keys are set: CORS decides only which
    #: pages may read the answers.
    cors_origins: tuple[str, ...] = setting(
        (), "LLAMAPOOL_CORS_ORIGINS", "web origins allowed (CORS)",
        shown="(* with keys)",
        flag="--cors-origins", parse=comma_list,
        help="comma-separated web origins allowed to call the API from a "
             "browser, '*', or 'localhost' for any page on this machine "
             "(llama.cpp's --cors-origins forms; default: '*' with API keys, "
             "none without)")
    #: The methods and headers a preflight grants; empty: the route's
    #: methods and the headers the page asked for (llama-server's ``*``).
    cors_methods: tuple[str, ...] = setting(
        (), "LLAMAPOOL_CORS_METHODS", "CORS methods (preflight)",
        shown="(the route's)", flag="--cors-methods", parse=comma_list,
        help="comma-separated methods a preflight allows (llama.cpp's "
             "--cors-methods; default: the route's own)")
    cors_headers: tuple[str, ...] = setting(
        (), "LLAMAPOOL_CORS_HEADERS", "CORS headers (preflight)",
        shown="(as asked)", flag="--cors-headers", parse=comma_list,
        help="comma-separated request headers a preflight allows (llama.cpp's "
             "--cors-headers; default: those the page asks for)")
    #: Credentialed requests (cookies, HTTP auth) from allowed origins: the
    #: origin is then reflected, never ``*``. Off by default, unlike
    #: llama-server: the API's keys travel in headers a script sets, which
    #: need no credentials mode, and reflecting every origin with
    #: credentials is the pattern browsers' ``*`` rule exists to prevent.
    cors_credentials: bool = setting(
        False, "LLAMAPOOL_CORS_CREDENTIALS", "CORS: allow credentials",
        shown="off", flag="--cors-credentials", const=True,
        help="allow credentialed requests from allowed origins (llama.cpp's "
             "--cors-credentials, on there by default)")
    #: Host names a request may be addressed to, besides the ones always
    #: served (``localhost``, ``*.localhost``, any IP address, this
    #: machine's name and the name ``--bind`` gives); ``*``: any. Another
    #: name gets 421, so a DNS-rebinding page is not served
    #: (``frontend.cors.HostCheckMiddleware``). Behind a proxy that passes
    #: the client's Host on, list the names clients use.
    allowed_hosts: tuple[str, ...] = setting(
        (), "LLAMAPOOL_ALLOWED_HOSTS", "Host names served; 421 else",
        shown="(local, IPs)",
        flag="--allowed-hosts", parse=comma_list,
        help="comma-separated host names the API answers to (a leading '.' "
             "takes subdomains too), or '*'; localhost, IP addresses and "
             "this machine's name always")
    #: Whose cached prompts a request may reuse (``frontend.cache_scope``):
    #: ``key``, each API key its own (when there are several keys), or
    #: ``pool``, every key sharing one cache. A request's ``cache_salt``
    #: narrows either.
    cache_scope: str = setting(
        cache_scope_module.KEY, "LLAMAPOOL_CACHE_SCOPE",
        "prompt reuse: per key or pool",
        flag="--cache-scope", choices=cache_scope_module.SCOPES,
        help="key: cached prompts are reused only for the API key that sent "
             "them (with several keys); pool: across all keys, which can "
             "then learn each other's prompts from cached_tokens and timing")

    def __post_init__(self) -> None:
        split_endpoints(self.broker_endpoint)  # ConfigError if empty or repeated
        if self.tokenizer_model and self.models_file:
            raise ConfigError("give LLAMAPOOL_TOKENIZER_MODEL (--model) or "
                              "LLAMAPOOL_MODELS_FILE (--models), not both")
        # At most one of the chat template settings.
        checked_chat_choice(self.chat_format, self.chat_template,
                            self.chat_template_file)
        if self.cache_scope not in cache_scope_module.SCOPES:
            raise ConfigError(f"LLAMAPOOL_CACHE_SCOPE={self.cache_scope!r} must be "
                              f"one of {', '.join(cache_scope_module.SCOPES)}")
        if "*" in self.cors_origins and self.cors_origins != ("*",):
            raise ConfigError("LLAMAPOOL_CORS_ORIGINS is '*' or a list of "
                              f"origins, not {','.join(self.cors_origins)!r}")
        if "*" in self.allowed_hosts and self.allowed_hosts != ("*",):
            raise ConfigError("LLAMAPOOL_ALLOWED_HOSTS is '*' or a list of "
                              f"names, not {','.join(self.allowed_hosts)!r}")
        # Zero would make sockets non-blocking or close every connection.
        for name in ("header_timeout_s", "body_timeout_s", "send_timeout_s",
                     "max_pending_connections"):
            if not getattr(self, name) > 0:
                env = self.__dataclass_fields__[name].metadata["env"]
                raise ConfigError(f"{env} must be above 0, not {getattr(self, name)}")

    def web_origins(self) -> tuple[str, ...]:
        """The origins CORS grants: as given, else ``*`` with keys and none
        without (``cors_origins``)."""
        if self.cors_origins:
            return self.cors_origins
        return ("*",) if self.keys_required else ()

    @property
    def chat_choice(self) -> str | None:
        """The chat format, template name or file, as one string for the
        prompt builder (``protocol.chat_choice``)."""
        return chat_choice(self.chat_format, self.chat_template,
                           self.chat_template_file)

    @property
    def keys_required(self) -> bool:
        """Whether requests need a key (``--api-key``, ``--api-key-file`` or
        ``--keys-file``)."""
        return bool(self.api_keys or self.keys_file)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FrontendSettings:
        """Load from ``env``, with the key file's keys added to ``api_keys``."""
        settings = load(cls, env)
        if not settings.api_key_file:
            return settings
        keys = (*settings.api_keys, *read_key_file(settings.api_key_file))
        return dataclasses.replace(settings, api_keys=keys)
