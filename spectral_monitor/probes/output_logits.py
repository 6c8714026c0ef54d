"""Capture of a language model's output logits (its LM head's output) on logging steps.

While armed, a forward hook on the LM head keeps a detached copy of its output for the first
``max_sequences`` sequences of the batch, with its real tokens as the forward's padding masks say them
(:mod:`spectral_monitor.probes.token_masks`: a Hugging Face ``attention_mask``, else the batch's token mask
given to ``arm()``); the hooks exist
only between arm and disarm, consumes no RNG and changes nothing of the forward. The LM head is the module
named by the user, else a Hugging Face model's ``get_output_embeddings()``, else the last ``nn.Linear``
whose ``out_features`` equals the vocabulary size of the model's first ``nn.Embedding``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from spectral_monitor.probes.attention_families import AttentionFamilies
from spectral_monitor.probes.token_masks import ForwardTokenMasks
from spectral_monitor.probes.wrappers import unwrapped_named_modules
from spectral_monitor.validation import check_instance

__all__ = ["OutputLogitCapture", "OutputLogitSample", "find_lm_head"]


@dataclass
class OutputLogitSample:
    """The LM head's output for the sampled sequences.

    Attributes:
        layer: The LM head's module name.
        logits: (S, n, V), a detached copy in the forward's dtype.
        token_mask: (S, n) bool, True = real token, or ``None`` when every token counts.

    Examples:
        >>> import torch
        >>> sample = OutputLogitSample("lm_head", torch.zeros(1, 5, 10), None)
        >>> sample.logits.shape
        torch.Size([1, 5, 10])
    """

    layer: str
    logits: Tensor
    token_mask: Tensor | None


def find_lm_head(model: nn.Module, module_name: str | None = None) -> tuple[str, nn.Module]:
    """Find a language model's LM head.

    Args:
        model: The model.
        module_name: The head's module name, where the user names it.

    Returns:
        ``(name, module)``: the module named ``module_name`` if given; else ``get_output_embeddings()``
        of a Hugging Face model where that returns a module; else the last ``nn.Linear`` whose
        ``out_features`` is the vocabulary size of the first ``nn.Embedding``.

    Raises:
        ValueError: No such module, naming what is missing.

    Examples:
        >>> from torch import nn
        >>> find_lm_head(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10)))
        ('1', Linear(in_features=4, out_features=10, bias=True))
    """
    modules = list(unwrapped_named_modules(model))
    if module_name is not None:
        for name, module in modules:
            if name == module_name:
                return name, module
        raise ValueError(
            f"output_logits names the module {module_name!r}, which {type(model).__name__} does not have; "
            f"its modules look like {[name for name, _ in modules[1:6]]}"
        )
    for _, module in modules:
        get_output_embeddings = getattr(module, "get_output_embeddings", None)
        head = get_output_embeddings() if callable(get_output_embeddings) else None
        if isinstance(head, nn.Module):
            for name, candidate in modules:
                if candidate is head:
                    return name, head
    embeddings = [module for _, module in modules if isinstance(module, nn.Embedding)]
    if embeddings:
        vocabulary = embeddings[0].num_embeddings
        heads = [
            (name, module)
            for name, module in modules
            if isinstance(module, nn.Linear) and module.out_features == vocabulary
        ]
        if heads:
            return heads[-1]
    raise ValueError(
        f"output_logits found no LM head in {type(model).__name__}: no get_output_embeddings() and no "
        "nn.Linear whose out_features equals the first nn.Embedding's num_embeddings; name it "
        "(output_logits='<module name>')"
    )


class OutputLogitCapture:
    """Keeps the LM head's output of one armed forward (the first call while armed).

    Args:
        model: The language model.
        module_name: The LM head's module name; by default found by :func:`find_lm_head`.
        max_sequences: Sequences of the batch kept.
        attention_families: Whose mask keywords say the real tokens (None: ``AttentionFamilies()``).

    Attributes:
        layer: The LM head's module name.
        head: The LM head.

    Raises:
        ValueError: No LM head is found, or ``attention_families`` is not an ``AttentionFamilies``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
        >>> capture = OutputLogitCapture(model, max_sequences=1)
        >>> capture.arm()
        >>> _ = model(torch.zeros(3, 5, dtype=torch.long))
        >>> sample = capture.disarm()
        >>> sample.layer, sample.logits.shape, capture.is_armed
        ('1', torch.Size([1, 5, 10]), False)
    """

    def __init__(
        self,
        model: nn.Module,
        module_name: str | None = None,
        max_sequences: int = 2,
        attention_families: AttentionFamilies | None = None,
    ) -> None:
        self.model = model
        self.attention_families = check_instance("attention_families", attention_families, AttentionFamilies)
        self.layer, self.head = find_lm_head(model, module_name)
        self.max_sequences = max_sequences
        self._handle: RemovableHandle | None = None
        self._token_masks: ForwardTokenMasks | None = None
        self._sample: OutputLogitSample | None = None

    @property
    def is_armed(self) -> bool:
        """Whether the head is hooked."""
        return self._handle is not None

    def arm(self, token_mask: Tensor | None = None, *, every_module: bool = False) -> None:
        """Hook the head until :meth:`disarm`.

        Args:
            token_mask: (B, n) bool, True = real token, where the forward's own masks do not say.
            every_module: As :meth:`AttentionCapture.arm <spectral_monitor.probes.AttentionCapture.arm>`.
        """
        self.disarm()
        self._token_masks = ForwardTokenMasks(token_mask, self.attention_families)
        self._token_masks.install(self.model, every_module=every_module)
        self._handle = self.head.register_forward_hook(self._keep)

    def disarm(self) -> OutputLogitSample | None:
        """Remove the hooks.

        Returns:
            What was captured, ``None`` when the head did not run.
        """
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._token_masks is not None:
            self._token_masks.remove()
            self._token_masks = None
        sample, self._sample = self._sample, None
        return sample

    def _keep(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if torch.compiler.is_compiling():
            return  # traced into a compiled graph: measured by a probe forward instead
        if self._sample is not None or not isinstance(output, Tensor) or output.dim() != 3:
            return  # later calls in the same forward, or an output that is not (B, n, V)
        sequences = min(self.max_sequences, output.shape[0])
        logits = output[:sequences].detach().clone()
        real = (
            None
            if self._token_masks is None
            else self._token_masks.real_tokens(output.shape[1], output.shape[0])
        )
        if real is not None:
            real = real[:sequences].to(logits.device).clone()
        self._sample = OutputLogitSample(self.layer, logits, real)
