"""Data parallelism on ``torch.distributed``, set up by ``accelerate`` (one process per device).

A script started by ``accelerate launch`` or ``torchrun`` finds ``WORLD_SIZE`` and friends in its
environment; :func:`context` then joins the process group through accelerate (NCCL on GPUs, gloo
on CPU). A plain ``python`` run is world size 1 and every collective here is a no-op, so the
trainers have one code path. Ranks must call the collectives in the same order: the trainers make
every decision that leads to one (update or not, how many mini-batches) from all-reduced counts.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist

_BUCKET = 1 << 24  # gradient elements per all-reduce: bounds the flat copy's memory


@dataclass(frozen=True)
class Context:
    """This process's place in the job: ``rank`` of ``world_size``, and the device it trains on."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes checkpoints, exports and W&B."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    # ---- collectives (no-ops for one process) ------------------------------------------------
    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (float64, so integer counts stay exact)."""
        if not self.active:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def max(self, value: int) -> int:
        """The largest ``value`` over the ranks (how many mini-batches every rank must step through)."""
        return max(self.gather(value))

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def sum_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Sum the ranks' gradients: each rank backpropagates its share of the global mini-batch's
        mean loss, so the sum is that mean's gradient (no pass over the gradients to divide them; a
        no-op in one process). A parameter without a gradient on every rank keeps ``None``, as in
        one process, so the optimizer skips it there too."""
        if not self.active:
            return
        params = [p for p in parameters if p.requires_grad]
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(present)
        params = [p for p, seen in zip(params, present.tolist()) if seen]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _buckets(params):
            flat = torch.cat([p.grad.reshape(-1).to(self._comm_device) for p in bucket])
            dist.all_reduce(flat)
            for p, part in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(part.view_as(p.grad))

    @property
    def _comm_device(self) -> torch.device:
        """gloo reduces CPU tensors, NCCL CUDA ones."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def _buckets(params: list[torch.nn.Parameter]):
    bucket, size = [], 0
    for p in params:
        if bucket and (size + p.numel() > _BUCKET or p.grad.dtype != bucket[0].grad.dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        yield bucket


@cache
def context() -> Context:
    """This process's context; joins the process group when a launcher started several processes."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        from .devices import default_device

        return Context(0, 1, default_device())
    from accelerate import PartialState

    # accelerate picks NCCL and cuda:LOCAL_RANK on GPUs; told cpu=True it uses gloo on the CPU.
    state = PartialState(cpu=not torch.cuda.is_available())
    atexit.register(_leave)
    device = state.device if state.device.type == "cuda" else torch.device("cpu")
    return Context(state.process_index, state.num_processes, device)


def _leave() -> None:
    """Close the process group before the interpreter tears down: a rank that exits with gloo's
    threads still running (rank 1 is done while rank 0 still uploads) dies by SIGABRT ("terminate
    called without an active exception"), and the launcher then kills rank 0 mid-upload."""
    if dist.is_initialized():
        dist.destroy_process_group()
