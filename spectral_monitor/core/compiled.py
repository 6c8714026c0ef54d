"""Whether a model's logging steps are measured during its training forward or by a probe forward.

Hooks installed around a forward that runs as ``torch.compile`` graphs record nothing (and adding them makes
Dynamo recompile), so a compiled model is never armed during its training forward: its logging steps are
measured by a probe forward of the same modules with compilation off, on the step's batch, in eval mode under
``no_grad`` with every random stream restored (:func:`spectral_monitor.probes.wrappers.probe_forward`), at
the session's ``end_forward``. A model given compiled is known at the start of the run; one given uncompiled
and compiled later is found by a forward pre-hook on a logging step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from spectral_monitor.probes.wrappers import compiled_module_names

__all__ = ["CompiledForwards"]


class CompiledForwards:
    """Tells the session whether to measure by a probe forward, and finds a forward that ran compiled.

    ``by_probe_forward`` is False at the start of a run unless the model holds ``torch.compile`` wrappers;
    once a watched forward is seen running compiled it is True for the rest of the run. The switch is logged
    once, at INFO, by the process whose ``writes`` is True (the writing rank only).

    Attributes:
        by_probe_forward: whether the run's logging steps are measured by a probe forward rather than by
            hooks armed during the training forward.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model, forwards = nn.Linear(2, 2), CompiledForwards()
        >>> forwards.start(model, writes=False)
        >>> forwards.watch(model)
        >>> _ = model(torch.ones(1, 2))  # eager: no compiled graph ran
        >>> forwards.unwatch(writes=False), forwards.by_probe_forward
        (False, False)
    """

    def __init__(self) -> None:
        self.by_probe_forward = False
        self._ran_compiled = False
        self._detector: torch.utils.hooks.RemovableHandle | None = None

    def start(self, model: nn.Module, *, writes: bool) -> None:
        """Begin a run on ``model``: measured by a probe forward from the start where it runs compiled.

        Args:
            model: the trained model; it is compiled if any of its modules is a ``torch.compile`` wrapper.
            writes: whether this process logs the switch to probe forwards.
        """
        self.by_probe_forward = self._ran_compiled = False
        if compiled_module_names(model):
            self._use_probe_forward("runs as torch.compile graphs", writes)

    def watch(self, model: nn.Module) -> None:
        """Watch the next forward of ``model`` (a logging step's, armed) for running compiled.

        A forward pre-hook is installed on ``model`` until :meth:`unwatch`.

        Args:
            model: the trained model.
        """
        self._detector = model.register_forward_pre_hook(self._notice)

    def unwatch(self, *, writes: bool) -> bool:
        """Stop watching; switch the run to probe forwards if the watched forward ran compiled.

        Args:
            writes: whether this process logs the switch to probe forwards.

        Returns:
            True only when the watched forward ran compiled and the run was not already measured by probe
            forwards: the armed hooks recorded nothing (they were traced into the graph), so the step must
            be measured by a probe forward.
        """
        if self._detector is not None:
            self._detector.remove()
            self._detector = None
        if not self._ran_compiled or self.by_probe_forward:
            return False
        self._use_probe_forward("ran compiled (the forward went through a torch.compile wrapper)", writes)
        return True

    def _notice(self, module: nn.Module, args: Any) -> None:
        # Dynamo traces this hook into a compiled graph with is_compiling() constant True: the assignment
        # is replayed after the graph, and nothing else is added to it.
        if torch.compiler.is_compiling():
            self._ran_compiled = True

    def _use_probe_forward(self, how: str, writes: bool) -> None:
        self.by_probe_forward = True
        if writes:
            logging.getLogger("spectral_monitor").info(
                "SpectralMonitor: the model %s; nothing is installed on it during training forwards, and on "
                "logging steps attention, tokens and output logits are measured by a forward of the same "
                "modules run eagerly on the step's batch, in eval mode (no dropout) under no_grad.",
                how,
            )
