"""The frontend's settings: one frozen object, built from ``LLAMAPOOL_*``.

gunicorn forks the app, so the CLI (``llamapool frontend``) passes its flags
to the workers as environment variables and ``llamapool.wsgi`` reads them here.
Every default is documented in this one place.

| variable                         | default        | meaning                      |
|----------------------------------|----------------|------------------------------|
| LLAMAPOOL_BROKER                 | (required)     | broker frontends endpoint    |
| LLAMAPOOL_API_KEYS               | (none)         | comma-separated keys         |
| LLAMAPOOL_API_KEY_FILE           | (none)         | file with one key per line   |
| LLAMAPOOL_MAX_BODY_BYTES         | 1048576        | larger bodies get 413        |
| LLAMAPOOL_SUBMIT_TIMEOUT_S       | 5              | wait for the broker's answer |
| LLAMAPOOL_FRAME_TIMEOUT_S        | 600            | longest silence mid-job      |
| LLAMAPOOL_HEALTH_TIMEOUT_S       | 1              | /health never blocks longer  |
| LLAMAPOOL_HEARTBEAT_INTERVAL_S   | 1              | heartbeat to the broker      |
| LLAMAPOOL_HEARTBEAT_LIVENESS     | 3              | missed beats = broker lost   |
| LLAMAPOOL_MODEL_NAME             | (from workers) | name when no worker is known |
| LLAMAPOOL_SLOTS_DEBUG            | 0              | /slots may show text         |
| LLAMAPOOL_TOKENIZER_MODEL        | (none)         | GGUF to count prompt tokens  |
| LLAMAPOOL_CHAT_FORMAT            | (template)     | same as the workers' format  |
| LLAMAPOOL_CTX                    | 2048           | workers' context size        |
| LLAMAPOOL_STREAM_SNDBUF_BYTES    | 65536          | kernel buffer per SSE stream |
| LLAMAPOOL_CURVE_SERVER_KEY       | (none)         | broker's public .key (CURVE) |
| LLAMAPOOL_CURVE_SECRET_KEY       | (none)         | own .key_secret (CURVE)      |
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from protocol import timing


class ConfigError(ValueError):
    """A setting is missing or malformed."""


def read_key_file(path: str) -> list[str]:
    """Keys from a file, one per line; blank lines and ``#`` comments skipped."""
    with open(path, encoding="utf-8") as f:
        lines = (line.strip() for line in f)
        return [line for line in lines if line and not line.startswith("#")]


@dataclasses.dataclass(frozen=True)
class FrontendSettings:
    broker_endpoint: str
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 1024 * 1024
    submit_timeout_s: float = timing.SUBMIT_TIMEOUT_S
    frame_timeout_s: float = 600.0
    health_timeout_s: float = 1.0
    heartbeat_interval_s: float = timing.HEARTBEAT_INTERVAL_S
    heartbeat_liveness: int = timing.HEARTBEAT_LIVENESS
    model_name: str = ""
    slots_debug: bool = False
    #: Frames the client consumes before the frontend returns credit.
    credit_batch_frames: int = timing.CREDIT_WINDOW_FRAMES // 4
    tokenizer_model: str = ""
    chat_format: str | None = None
    n_ctx: int = 2048
    stream_sndbuf_bytes: int = 65536
    #: CURVE key files for the broker link (``protocol.curve``); empty: plaintext.
    curve_server_key: str = ""
    curve_secret_key: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FrontendSettings:
        env = os.environ if env is None else env
        broker = env.get("LLAMAPOOL_BROKER", "")
        if not broker:
            raise ConfigError("LLAMAPOOL_BROKER is not set")
        keys = [k.strip() for k in env.get("LLAMAPOOL_API_KEYS", "").split(",")]
        if env.get("LLAMAPOOL_API_KEY_FILE"):
            keys += read_key_file(env["LLAMAPOOL_API_KEY_FILE"])

        def number(name: str, default: float, kind=float):
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return kind(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a {kind.__name__}") from None

        return cls(
            broker_endpoint=broker,
            api_keys=tuple(k for k in keys if k),
            max_body_bytes=number("LLAMAPOOL_MAX_BODY_BYTES", cls.max_body_bytes, int),
            submit_timeout_s=number("LLAMAPOOL_SUBMIT_TIMEOUT_S", cls.submit_timeout_s),
            frame_timeout_s=number("LLAMAPOOL_FRAME_TIMEOUT_S", cls.frame_timeout_s),
            health_timeout_s=number("LLAMAPOOL_HEALTH_TIMEOUT_S", cls.health_timeout_s),
            heartbeat_interval_s=number(
                "LLAMAPOOL_HEARTBEAT_INTERVAL_S", cls.heartbeat_interval_s
            ),
            heartbeat_liveness=number(
                "LLAMAPOOL_HEARTBEAT_LIVENESS", cls.heartbeat_liveness, int
            ),
            model_name=env.get("LLAMAPOOL_MODEL_NAME", ""),
            slots_debug=env.get("LLAMAPOOL_SLOTS_DEBUG", "0") in ("1", "true", "yes"),
            tokenizer_model=env.get("LLAMAPOOL_TOKENIZER_MODEL", ""),
            chat_format=env.get("LLAMAPOOL_CHAT_FORMAT") or None,
            n_ctx=number("LLAMAPOOL_CTX", cls.n_ctx, int),
            stream_sndbuf_bytes=number(
                "LLAMAPOOL_STREAM_SNDBUF_BYTES", cls.stream_sndbuf_bytes, int
            ),
            curve_server_key=env.get("LLAMAPOOL_CURVE_SERVER_KEY", ""),
            curve_secret_key=env.get("LLAMAPOOL_CURVE_SECRET_KEY", ""),
        )
