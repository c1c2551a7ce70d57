"""The process group: who this rank is, how many there are, who writes, and collectives with timeouts.

A single process (no torchrun / srun environment) is a world of size 1 and every collective is the identity,
so stages have one code path. Under ``torchrun`` (or ``srun`` with the torchrun variables set) the world is
initialised once, by the CLI, with NCCL when the device is CUDA and gloo otherwise; every collective runs under
the group's timeout, so a rank that dies ends the job on every rank instead of hanging it.

Stages ask the world which share of the work is theirs (``shard``) and exchange results through its
collectives; only the writer (rank 0) touches the run directory. ``algos/`` never imports this module.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class World:
    """This process's place in the job. ``size == 1`` means no process group exists."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def is_writer(self) -> bool:
        """Only rank 0 writes the run directory (manifest, artifacts, checkpoints)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous share of ``items`` (sizes differ by at most one; earlier ranks take more)."""
        n, r = divmod(len(items), self.size)
        start = self.rank * n + min(self.rank, r)
        return list(items[start : start + n + (self.rank < r)])

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place (and return it)."""
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as rank ``src`` has it, on every rank (picklable objects)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()


SINGLE = World()


def env_world_size() -> int:
    """World size the launcher announced (torchrun's ``WORLD_SIZE``), 1 without a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_world(device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join the process group the launcher set up (env:// rendezvous), or return the size-1 world.

    ``device`` is the resolved device type of this job (``cuda`` or ``cpu``): NCCL for CUDA, gloo otherwise.
    Each CUDA rank uses GPU ``LOCAL_RANK``.
    """
    size = env_world_size()
    if size <= 1:
        return SINGLE
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    log.debug("rank %d of %d (local %d) joined with %s", rank, size, local_rank, backend)
    return World(rank, size, local_rank, backend)


def close_world(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
