"""Whether llama.cpp may repack a model's weights (``--repack``).

On load, llama.cpp's CPU backend may move quantized weights into an "extra"
buffer type laid out for this CPU's matmul kernels: ``CPU_REPACK`` (the
AVX2/AVX-512/NEON interleaved layouts) and, on a CPU with Intel AMX, the AMX
buffer. llama-cpp-python calls this ``model_params.use_extra_bufts``;
llama-server's ``--no-repack`` turns it off.

At the llama.cpp that llama-cpp-python 0.3.36 vendors, the AMX matmul
crashes on Q4_K weights (SIGSEGV at ``ldtilecfg`` in
``ggml_backend_amx_mul_mat``, SIGILL in llama-server's warm-up; llama.cpp
issue #20824, PR #26954: the XTILEDATA permission is requested for one
thread only and the tile configuration lives on the stack). Turning the
extra buffers off is the only switch that avoids the AMX buffer, and it
turns off ``CPU_REPACK`` with it, so ``auto`` does that only on a CPU that
has AMX. Everywhere else repacking stays on: it is what makes Q4_0/Q4_K
decoding fast on AVX2 (docs/benchmarks/20-weight-repacking.md).

To drop the workaround once the vendored llama.cpp carries the fix (PR
#26954 merged, and a llama-cpp-python release that vendors it): make
``auto`` mean ``on`` everywhere in ``repack_enabled`` (keep the setting: it
is llama-server's ``--no-repack``), and run ``make test`` and the Gemma
tests on an AMX machine.
"""

from __future__ import annotations

import dataclasses

#: ``--repack`` values (``LLAMAPOOL_REPACK``).
REPACK_CHOICES = ("auto", "on", "off")

#: The CPU flags (``/proc/cpuinfo``) of AMX's integer tiles, which
#: llama.cpp's AMX buffer uses for quantized weights.
_AMX_FLAGS = frozenset({"amx_tile", "amx_int8"})


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags (empty where there is no cpuinfo)."""
    try:
        with open(cpuinfo_path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_has_amx(flags: frozenset[str] | None = None) -> bool:
    return _AMX_FLAGS <= (cpu_flags() if flags is None else flags)


@dataclasses.dataclass(frozen=True)
class RepackChoice:
    """What ``--repack`` resolved to on this host, and why (for ``/slots``)."""

    enabled: bool
    reason: str

    @property
    def shown(self) -> str:
        """``on (auto: ...)``: the value ``/slots`` and the log show."""
        return f"{'on' if self.enabled else 'off'} ({self.reason})"


def repack_enabled(setting: str, flags: frozenset[str] | None = None) -> RepackChoice:
    """Resolve ``--repack`` (``auto``, ``on`` or ``off``) for this CPU."""
    if setting == "on":
        return RepackChoice(True, "--repack on")
    if setting == "off":
        return RepackChoice(False, "--repack off")
    if cpu_has_amx(flags):
        return RepackChoice(False, "auto: this CPU has AMX, whose llama.cpp "
                                   "kernel crashes (llama.cpp #20824)")
    return RepackChoice(True, "auto: no AMX on this CPU")
