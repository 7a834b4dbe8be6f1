"""``JobSink``s (``workers.model.engine``) for running an engine in process,
in tests and benchmarks: ``NullSink`` takes everything at once and keeps
nothing; ``RecordingSink`` keeps the text and can cancel."""

from __future__ import annotations


class NullSink:
    """Credit is never short, nothing is cancelled, the thread count is fixed."""

    def emit(self, text: str, n_tokens: int, **frame_extras) -> None:
        pass

    def emit_embedding(self, vector: bytes, n_tokens: int) -> None:
        pass

    def should_stop(self) -> bool:
        return False

    def wait_for_credit(self) -> bool:
        return True

    def report_progress(self, *args) -> None:
        pass

    def threads_to_use(self, current: int) -> int:
        return current


class RecordingSink(NullSink):
    """Keeps every frame's text and token count; cancels after
    ``cancel_after`` frames if given."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.frames: list[tuple[str, int]] = []
        self.cancel_after = cancel_after

    def emit(self, text: str, n_tokens: int, **frame_extras) -> None:
        self.frames.append((text, n_tokens))

    def should_stop(self) -> bool:
        return self.cancel_after is not None and len(self.frames) >= self.cancel_after

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.frames)
