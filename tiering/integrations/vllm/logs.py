"""tiering's log lines in vLLM's log, in vLLM's format (layer 5: the vLLM glue).

vLLM configures the ``vllm`` logger only (``vllm.logger.DEFAULT_LOGGING_CONFIG``:
one stream handler, vLLM's formatter, ``propagate`` off). A ``tiering.*`` logger
propagates to the root logger, which in vLLM's server has no handler: its INFO
lines are lost and its warnings come out bare through `logging.lastResort`,
without the level, time and ``[file:line]`` the operator reads vLLM's log by.

`adopt_vllm_logging`, called when tiering's vLLM pieces are built (the spec,
its cache policies, the secondary tiers), gives the ``tiering`` logger one
`VllmHandlers`: it hands each record to the handlers the ``vllm`` logger has
at that moment (so a later reconfiguration by vLLM is followed), each at its
own level, as ``vllm``'s own records are. The ``tiering`` logger takes the
``vllm`` logger's level and stops propagating, so no line is printed twice.

It leaves logging alone where the operator decided: where vLLM's logging is
not configured (``VLLM_CONFIGURE_LOGGING=0``: the ``vllm`` logger has no
handler), and where the ``tiering`` logger or the root logger has handlers of
its own (a ``VLLM_LOGGING_CONFIG_PATH`` file that routes them, or the
embedding program's ``logging.basicConfig``), or does not propagate (a file
that silenced it). A level the operator gave the ``tiering`` logger is kept.
Calling it again changes nothing; two threads adopting at once add one handler.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["VllmHandlers", "adopt_vllm_logging"]

_VLLM = "vllm"
_TIERING = "tiering"
#: Held while adopting: two pieces built on two threads at once add one handler.
_ADOPTING = threading.Lock()


class VllmHandlers(logging.Handler):
    """Hands a record to the handlers of the ``vllm`` logger, as that logger would."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger(_VLLM).handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def adopt_vllm_logging() -> bool:
    """Route the ``tiering`` logger's records to vLLM's handlers, unless the operator
    configured logging for tiering (see the module's docstring); idempotent.

    Returns whether the ``tiering`` logger emits through vLLM's handlers now.
    """
    tiering = logging.getLogger(_TIERING)
    with _ADOPTING:
        if any(isinstance(handler, VllmHandlers) for handler in tiering.handlers):
            return True
        vllm = logging.getLogger(_VLLM)
        if not vllm.handlers or tiering.handlers or logging.getLogger().handlers:
            return False
        if not tiering.propagate:  # the operator's config turned it off (not ours: above)
            return False
        if tiering.level == logging.NOTSET:
            tiering.setLevel(vllm.getEffectiveLevel())
        tiering.addHandler(VllmHandlers())
        tiering.propagate = False
        return True
