"""A ``JobSink`` (``workers.model.engine``) that takes everything at once and
keeps nothing: for running an engine in process, in tests and benchmarks."""

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
