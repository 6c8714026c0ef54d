"""Every collective the monitor takes part in, in one place: all ranks call these, in the same order.

Under DDP and FSDP each rank runs the monitor's hooks on its own batch. A collective (all-reduce, gather)
completes only when every rank of the process group enters it, so a probe that reduces across ranks must
be entered by every rank on the same steps with the same arguments; a rank that skips one leaves the others
waiting forever. The rules that keep that true:

- Decide *whether* to measure from things every rank agrees on (the step, the configuration, counters
  advanced on every rank), never from a rank's data or from whether it writes (only global rank 0 writes,
  but every rank measures).
- A decision taken from data that changes how many collectives follow (an iterative solver stopping on
  its tolerance) is taken from reduced quantities: :func:`on_every_rank` agrees on it.
- Reduce through the functions below, not through ``torch.distributed`` directly, so the list of
  collectives the monitor uses is this module. Each is a no-op (returns its input) without an initialised
  process group or with one rank, so the same code runs in a single process.

Uses:

- :func:`full_parameters` gathers FSDP-sharded weights for the weight probe.
- :func:`mean_over_ranks_` averages each Hessian-vector product of the curvature probe over the ranks'
  probe batches (one flattened tensor per block of products), so the sharpness is that of the global
  batch; :func:`on_every_rank` makes its Lanczos runs stop on the same iteration on every rank
  (``BatchedOperator.agreed``). The products run on the unwrapped LightningModule, whose forward does not
  go through DDP, so DDP's gradient all-reduce does not fire inside them (DDP does not support double
  backward through its wrapper anyway).
- :func:`any_rank` is how ranks agree on decisions each takes from its own data: an alert's ``stop_on``
  stops every rank after the same step if any rank's rule fired.
- :func:`global_rank` tells the second-order probes whether the probe batch of a checkpoint is their own
  (a checkpoint holds global rank 0's callback state; every rank reads it on resume).
- :func:`sharded_parameters` names what the curvature, Jacobian and NTK probes refuse: under FSDP their
  forwards would all-gather shards a data-dependent number of times per rank, and a Hessian-vector product
  needs the sharded parameters in the autograd graph twice, which is not built. DDP is the alternative.

Collectives on NCCL need CUDA tensors: the helpers move what they reduce to the backend's device and back.
A failure inside a probe between two collectives on one rank only (its data alone makes it raise) leaves
the other ranks waiting in the next collective until the process group's timeout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "any_rank",
    "full_parameters",
    "global_rank",
    "is_distributed",
    "mean_over_ranks_",
    "on_every_rank",
    "rank_zero_seed",
    "sharded_parameters",
]


def is_distributed() -> bool:
    """Whether a process group with more than one rank is initialised, so the collectives below do work.

    Collective-free.

    Returns:
        True under an initialised process group of world size > 1; False otherwise (the helpers of this
        module then return their input).

    Examples:
        In a single process:

        >>> is_distributed()
        False
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def global_rank() -> int:
    """This process's rank in the initialised process group. Collective-free.

    Returns:
        The global rank, in [0, world size); 0 without an initialised process group.

    Examples:
        >>> global_rank()
        0
    """
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def mean_over_ranks_(tensors: Sequence[Tensor]) -> Sequence[Tensor]:
    """Replaces each tensor by its mean over the ranks, in place. Every rank calls it.

    One all-reduce per tensor, in the order given, so every rank must pass tensors of the same shapes and
    dtypes in the same order. Each tensor keeps its device; on NCCL it is reduced through a CUDA copy.

    Args:
        tensors: Floating-point tensors, overwritten with their mean over the ranks.

    Returns:
        ``tensors`` itself, untouched without a process group of more than one rank.

    Examples:
        In a single process the mean over one rank is the tensor:

        >>> import torch
        >>> products = [torch.tensor([1.0, 2.0])]
        >>> mean_over_ranks_(products) is products, products[0].tolist()
        (True, [1.0, 2.0])
    """
    if not is_distributed():
        return tensors
    device = _collective_device()
    for tensor in tensors:
        reduced = tensor.to(device)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        tensor.copy_(reduced.div_(dist.get_world_size()))
    return tensors


def any_rank(flags: Sequence[bool]) -> list[bool]:
    """For each flag, whether it is true on at least one rank. Every rank calls it.

    One all-reduce (max) for all the flags, so every rank must pass as many, in the same order; every rank
    gets the same answer.

    Args:
        flags: This rank's flags, read as ``bool``.

    Returns:
        One bool per flag: whether it is true on some rank (this rank's flags without a process group).

    Examples:
        >>> any_rank([False, 1])
        [False, True]
    """
    votes = torch.tensor([int(bool(flag)) for flag in flags], dtype=torch.int32)
    return [bool(vote) for vote in _reduced(votes, dist.ReduceOp.MAX).tolist()]


def on_every_rank(flags: Tensor) -> Tensor:
    """Elementwise: whether each flag is true on every rank. Every rank calls it.

    One all-reduce (min), so every rank must pass the same shape; every rank gets the same answer. This is
    how an iterative solver whose stopping depends on each rank's data stops on the same iteration
    everywhere.

    Args:
        flags: Bool tensor of this rank's flags, any shape, on any device.

    Returns:
        Bool tensor of the shape and device of ``flags``: true where every rank's flag is (``flags``
        without a process group).

    Examples:
        >>> import torch
        >>> on_every_rank(torch.tensor([True, False]))
        tensor([ True, False])
    """
    return _reduced(flags.to(torch.int32), dist.ReduceOp.MIN).to(device=flags.device, dtype=torch.bool)


def rank_zero_seed() -> int:
    """A seed drawn from the operating system on rank 0 and shared by every rank. Every rank calls it.

    Random starts of a computation the ranks run together (the start vector of a Lanczos run over the mean
    Hessian) then agree. One broadcast from rank 0.

    Returns:
        An int in [0, 2⁶³): rank 0's draw on every rank; this process's own draw without a process group.

    Examples:
        >>> import torch
        >>> seed = rank_zero_seed()
        >>> 0 <= seed < 2**63
        True
        >>> start = torch.randn(3, generator=torch.Generator().manual_seed(seed))  # the same on every rank
    """
    seed = torch.Generator().seed() % 2**63
    if not is_distributed():
        return seed
    shared = torch.tensor([seed], dtype=torch.int64, device=_collective_device())
    dist.broadcast(shared, src=0)
    return int(shared.item())


def _reduced(tensor: Tensor, op: dist.ReduceOp) -> Tensor:
    if not is_distributed():
        return tensor
    reduced = tensor.to(_collective_device())
    dist.all_reduce(reduced, op=op)
    return reduced.cpu()


@contextmanager
def full_parameters(model: nn.Module) -> Iterator[None]:
    """Inside, every FSDP-sharded parameter of ``model`` is whole (read-only); every rank must enter.

    For FSDP (``FullyShardedDataParallel``) it is ``summon_full_params(writeback=False)`` on each outermost
    FSDP module, so each parameter is its own full tensor again (FSDP's flat shards cut matrices at arbitrary
    element offsets, not at rows: a shard alone is no matrix); changes made inside are not written back. For
    FSDP2 (``fully_shard``) every ``FSDPModule`` is unsharded, and resharded on exit. A model without
    sharded parameters is left as it is, with no collective. Costs the memory of the whole unsharded model
    while inside.

    Args:
        model: The outermost module (Lightning: ``trainer.strategy.model``), so parameters owned by a root
            wrapper are gathered too.

    Yields:
        Nothing: the parameters are whole while the ``with`` block runs.

    Examples:
        On every rank, around what reads whole matrices (a model without sharded parameters is read as it
        is, so the same code runs in a single process):

        ```python
        with full_parameters(trainer.strategy.model):
            spectra = weight_spectra(pl_module)
        ```
    """
    fsdp_roots = _outermost_fsdp1(model)
    fsdp2_modules = [module for module in model.modules() if _is_fsdp2(module)]
    with ExitStack() as stack:
        if fsdp_roots:
            from torch.distributed.fsdp import FullyShardedDataParallel

            for root in fsdp_roots:
                stack.enter_context(FullyShardedDataParallel.summon_full_params(root, writeback=False))
        if fsdp2_modules:
            for module in fsdp2_modules:
                module.unshard()
            stack.callback(lambda: [module.reshard() for module in fsdp2_modules])
        yield


def sharded_parameters(model: nn.Module) -> list[str]:
    """What in ``model`` is sharded across ranks, by name. Collective-free.

    Args:
        model: The model as the strategy wrapped it.

    Returns:
        The qualified names of its FSDP (v1) and FSDP2 modules (a wrapping root by its class name); failing
        those, of its DTensor parameters; empty for a plain or DDP-wrapped model.

    Examples:
        How a probe that cannot run on shards refuses them:

        ```python
        if sharded := sharded_parameters(trainer.strategy.model):
            raise ValueError(f"sharded across ranks: {', '.join(sharded)}; use DDP")
        ```
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    wrapped = [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, FullyShardedDataParallel) or _is_fsdp2(module)
    ]
    if wrapped:
        return wrapped
    return [name for name, parameter in model.named_parameters() if isinstance(parameter, DTensor)]


def _outermost_fsdp1(model: nn.Module) -> list[nn.Module]:
    """The FSDP (v1) modules of ``model`` not inside another: summoning one gathers those nested in it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        return [model]
    return [module for child in model.children() for module in _outermost_fsdp1(child)]


def _is_fsdp2(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
