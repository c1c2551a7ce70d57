"""The process group: who this rank is, how many there are, who writes, who owns which work, and collectives
with timeouts.

A single process (no torchrun / srun environment) is a world of size 1 and every collective is the identity,
so stages have one code path. Under ``torchrun`` (or ``srun`` with the torchrun variables set) the world is
initialised once, by the CLI, with NCCL when the device is CUDA and gloo otherwise, plus a gloo group for small
Python objects. Every collective runs under the group's timeout (``QUANT_DIST_TIMEOUT_S``, default 1800 s), and
a failed one (a rank died, hung or raised) raises :class:`~quant.errors.DistError`: one error line on every
surviving rank instead of a hang.

Stages ask the world which share of the work is theirs (``shard``, :func:`even_ranges`, :func:`assign`) and
exchange results through its collectives (:meth:`World.exchange_tensors`, :class:`quant.parallel.relay.Relay`); only the
writer (rank 0) touches the run directory. ``algos/`` never imports this module.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch

from quant.errors import DistError, QuantError, StopRequested

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_TIMEOUT_S = 1800.0
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # ranks waiting for the writer's single-rank stages (export, report)
_PACK_BYTES = 256 << 20  # tensors are exchanged in flat byte buffers of about this size


class StopFlag:
    """A request to stop after the unit of work in hand (a layer): set by a signal handler (the CLI's) or by a
    stop file the writer polls. Mutable on purpose: signal handlers cannot reach anything else."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.file: Path | None = None

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason

    def local(self, writer: bool) -> str | None:
        if self.reason is None and writer and self.file is not None and self.file.exists():
            self.file.unlink(missing_ok=True)
            self.reason = f"stop file {self.file}"
        return self.reason


@dataclass(frozen=True)
class World:
    """This process's place in the job. ``size == 1`` means no process group exists. Made once per run by the
    caller (:func:`init_world` in the CLI; ``World()``, a world of one, for an in-process run or a test) and
    passed to every stage; its stop flag belongs to this run alone."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    local_size: int = 1  # processes of the job on this node (torchrun's LOCAL_WORLD_SIZE)
    stop: StopFlag = field(default_factory=StopFlag, compare=False, repr=False)
    groups: dict = field(default_factory=dict, compare=False, repr=False)  # "objects", "idle": gloo groups

    @property
    def is_writer(self) -> bool:
        """Only rank 0 writes the run directory (manifest, artifacts, checkpoints)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def device(self) -> torch.device:
        """Where tensors live for the tensor collectives (NCCL: this rank's GPU)."""
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    def alone(self) -> World:
        """This process as a world of one, for work it does by itself: same node, timeout and stop flag."""
        return World(local_rank=self.local_rank, timeout_s=self.timeout_s, local_size=self.local_size, stop=self.stop)

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous share of ``items`` (sizes differ by at most one; earlier ranks take more)."""
        n, r = divmod(len(items), self.size)
        start = self.rank * n + min(self.rank, r)
        return list(items[start : start + n + (self.rank < r)])

    @contextlib.contextmanager
    def _collective(self, what: str):
        """Turn a failed collective (peer died, timed out, raised) into one actionable DistError."""
        try:
            yield
        except (QuantError, KeyboardInterrupt):
            raise
        except Exception as e:  # RuntimeError, DistBackendError, DistNetworkError: all mean "the job is broken"
            first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:300]
            raise DistError(
                f"rank {self.rank} of {self.size}: {what} failed ({first}); another rank stopped, crashed or "
                f"did not answer within {self.timeout_s:g} s (QUANT_DIST_TIMEOUT_S); its log has the cause"
            ) from None

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place (and return it)."""
        if self.distributed:
            import torch.distributed as dist

            with self._collective("all_reduce"):
                dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def broadcast_object(self, obj: Any, src: int = 0, idle: bool = False) -> Any:
        """``obj`` as rank ``src`` has it, on every rank (picklable objects). ``idle``: wait as long as a
        single-rank stage may take (for ranks waiting on the writer)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        with self._collective("broadcast_object"):
            dist.broadcast_object_list(box, src=src, group=self.groups.get("idle" if idle else "objects"))
        return box[0]

    def all_gather_object(self, obj: Any, idle: bool = False) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank. ``idle``: wait as long as a stage may take."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        with self._collective("all_gather_object"):
            dist.all_gather_object(out, obj, group=self.groups.get("idle" if idle else "objects"))
        return out

    def barrier(self, idle: bool = False, what: str = "barrier") -> None:
        """Wait until every rank is here. ``idle``: wait as long as a stage may take."""
        if self.distributed:
            import torch.distributed as dist

            with self._collective(what):
                dist.barrier(group=self.groups.get("idle" if idle else "objects"))

    def broadcast_tensor(self, t: torch.Tensor, src: int) -> None:
        """In place: ``t`` (contiguous, on :attr:`device`) takes rank ``src``'s values."""
        if self.distributed:
            import torch.distributed as dist

            with self._collective("broadcast"):
                dist.broadcast(t, src=src)

    def send_tensor(self, t: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        with self._collective("send"):
            dist.send(t, dst=dst)

    def recv_tensor(self, t: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        with self._collective("recv"):
            dist.recv(t, src=src)

    def on_writer(self, fn: Callable[[], T]) -> T:
        """``fn()`` run by the writer alone, its result (or its error) on every rank. The other ranks wait without
        the collective timeout (single-rank stages such as export may take long)."""
        if not self.distributed:
            return fn()
        outcome: tuple[str, Any] = ("ok", None)
        if self.is_writer:
            try:
                outcome = ("ok", fn())
            except BaseException as e:  # every rank must learn of it, then the writer re-raises its own
                self.broadcast_object(("error", _portable(e, self.rank)), idle=True)
                raise
        outcome = self.broadcast_object(outcome, idle=True)
        if outcome[0] == "error":
            err = outcome[1]
            err.elsewhere = True  # the writer prints it; this rank exits with its code, silently
            raise err
        return outcome[1]

    def on_every_rank(self, fn: Callable[[], T]) -> list[T]:
        """``fn()`` run by every rank at once (each on its share of the work), every rank's result in rank order on
        every rank. An error on any rank ends every rank: the first failing rank raises (and prints) its own error,
        the others raise a copy of it silently, so the job shows one error line. Ranks that finish early wait for
        the slowest without the collective timeout; a rank that dies still ends the others at once."""
        if not self.distributed:
            return [fn()]
        outcome: tuple[str, Any]
        try:
            outcome, error = ("ok", fn()), None
        except Exception as e:  # noqa: BLE001 - every rank must learn of it; this rank re-raises its own below
            outcome, error = ("error", _portable(e, self.rank)), e
        outcomes = self.all_gather_object(outcome, idle=True)
        failed = [r for r, (status, _) in enumerate(outcomes) if status == "error"]
        if not failed:
            return [value for _, value in outcomes]
        if failed[0] == self.rank:
            raise error
        err = outcomes[failed[0]][1]
        err.elsewhere = True
        raise err

    def agree_stop(self) -> str | None:
        """The first stop request any rank has (signal or stop file), agreed by all ranks: every rank stops
        after the same unit of work."""
        return next((r for r in self.all_gather_object(self.stop.local(self.is_writer)) if r), None)

    def raise_if_stopped(self, done: str) -> None:
        reason = self.agree_stop()
        if reason:
            err = StopRequested(f"stopped on request ({reason}) after {done}; rerun the same command to resume")
            err.elsewhere = not self.is_writer  # one line for the job, from the writer
            raise err

    def max_over_ranks(self, value: int) -> int:
        return max(self.all_gather_object(value))

    def exchange_tensors(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's named tensors (names disjoint across ranks), on every rank: the union, each received
        tensor on :attr:`device`. Tensors travel as flat byte buffers of about 256 MB, one broadcast each."""
        if not self.distributed:
            return dict(mine)
        metas = self.all_gather_object([(n, tuple(t.shape), t.dtype) for n, t in mine.items()])
        out = dict(mine)
        for src, meta in enumerate(metas):
            for batch in _byte_batches(meta):
                if src == self.rank:
                    flat = torch.cat([_bytes(mine[n]).to(self.device) for n, _, _ in batch])
                else:
                    flat = torch.empty(sum(_nbytes(s, d) for _, s, d in batch), dtype=torch.uint8, device=self.device)
                self.broadcast_tensor(flat, src)
                if src != self.rank:
                    out.update(_unpack(flat, batch))
        return out


def _portable(e: BaseException, rank: int) -> BaseException:
    """An exception other ranks can re-raise: itself when it pickles and is a QuantError, else a QuantError naming
    ``rank``, the rank it happened on."""
    if isinstance(e, QuantError):
        try:
            pickle.loads(pickle.dumps(e))
            return e
        except Exception:  # noqa: BLE001 - an unpicklable error still needs a message
            pass
    return QuantError(f"rank {rank} failed: {type(e).__name__}: {e}")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _byte_batches(meta: list[tuple[str, tuple, torch.dtype]]) -> list[list[tuple[str, tuple, torch.dtype]]]:
    out, cur, size = [], [], 0
    for item in meta:
        if cur and size + _nbytes(item[1], item[2]) > _PACK_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += _nbytes(item[1], item[2])
    return out + ([cur] if cur else [])


def _unpack(flat: torch.Tensor, batch) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape, dtype in batch:
        n = _nbytes(shape, dtype)
        out[name] = flat[offset : offset + n].view(dtype).reshape(shape)
        offset += n
    return out


def even_ranges(n_items: int, size: int) -> list[range]:
    """``range(n_items)`` in ``size`` contiguous parts whose lengths differ by at most one (earlier parts longer)."""
    q, r = divmod(n_items, size)
    starts = [i * q + min(i, r) for i in range(size + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(size)]


def assign(costs: Sequence[float], loads: Sequence[float]) -> list[int]:
    """The rank of each item: longest first onto the rank with the least load so far (ties: the lower rank),
    starting from ``loads`` (one per rank). Deterministic, so every rank computes the same assignment."""
    loads = list(loads)
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(len(loads)), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += costs[i]
    return owner


def _env_int(name: str, default: int, low: int, high: int | None = None) -> int:
    """Integer variable ``name`` of the launcher's environment, within [low, high]; a DistError naming it if not."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise DistError(f"{name}={raw[:40]!r} is not an integer {bound}; torchrun sets it for each process: start "
                        f"quant with torchrun, or unset {name} to run as one process")
    return value


def env_world_size() -> int:
    """World size the launcher announced (torchrun's ``WORLD_SIZE``), 1 without a launcher."""
    return _env_int("WORLD_SIZE", 1, 1)


def collective_timeout_s(timeout_s: float | None = None) -> float:
    """``timeout_s``, else ``QUANT_DIST_TIMEOUT_S``, else 1800 s: a finite number of seconds above zero (0 timed out
    every collective at once, each rank blaming another), else a DistError naming the variable."""
    raw = str(timeout_s) if timeout_s is not None else os.environ.get("QUANT_DIST_TIMEOUT_S", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0 or value > IDLE_TIMEOUT_S:
        raise DistError(f"QUANT_DIST_TIMEOUT_S={raw[:40]!r}: the collective timeout must be a number of seconds above "
                        f"0 and at most {IDLE_TIMEOUT_S:g} (default {DEFAULT_TIMEOUT_S:g}); set it so on every rank, "
                        "or unset it")
    return value


def env_local_world_size() -> int:
    """Processes of the job on this node (torchrun's ``LOCAL_WORLD_SIZE``), 1 without a launcher."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise DistError(f"LOCAL_WORLD_SIZE is '{value}': it must be a whole number of processes on this node "
                        "(torchrun sets it; unset it outside a launcher)")
    return n


def _job_wide(err: DistError) -> DistError:
    """An error in a variable every rank of the job has alike (the launcher's sizes, quant's timeout): one error line
    for the job, from rank 0 or the process alone; the other ranks exit with it, quietly (the CLI prints no line for
    an error marked ``elsewhere``)."""
    rank = os.environ.get("RANK", "").strip()
    err.elsewhere = rank.isdigit() and int(rank) > 0
    return err


def init_world(device: str, timeout_s: float | None = None) -> World:
    """Join the process group the launcher set up (env:// rendezvous), or return a fresh size-1 world.

    ``device`` is the resolved device type of this job (``cuda`` or ``cpu``): NCCL for CUDA, gloo otherwise.
    Each CUDA rank uses GPU ``LOCAL_RANK``. ``timeout_s`` defaults to ``QUANT_DIST_TIMEOUT_S`` or 1800 s.
    """
    try:
        timeout_s = collective_timeout_s(timeout_s)
        size, local_size = env_world_size(), env_local_world_size()
    except DistError as e:
        raise _job_wide(e) from None
    if size <= 1:
        return World(timeout_s=timeout_s, local_size=local_size)
    import torch.distributed as dist

    if not os.environ.get("RANK", "").strip():
        raise DistError("WORLD_SIZE is set but RANK is not: start quant with torchrun (or set RANK, "
                        "LOCAL_RANK, MASTER_ADDR, MASTER_PORT for every process)")
    rank, local_rank = _env_int("RANK", 0, 0, size - 1), _env_int("LOCAL_RANK", 0, 0, size - 1)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise DistError(f"rank {rank}: LOCAL_RANK {local_rank} has no GPU of its own ({visible} visible on this "
                            f"node): start at most {visible} process(es) per node (torchrun --nproc-per-node "
                            f"{visible}), or run on CPUs with quantize.device: cpu")
        torch.cuda.set_device(local_rank)
    world = World(rank, size, local_rank, backend, timeout_s, local_size)
    with world._collective("joining the process group"):
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        objects = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        idle = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
    world.groups.update(objects=objects, idle=idle)
    log.debug("rank %d of %d (local %d) joined with %s", rank, size, local_rank, backend)
    return world


_EXIT_WITHOUT_TEARDOWN = False


def close_world(world: World, clean: bool = True) -> None:
    """Leave the process group; the process must then end through :func:`exit_process`.

    ``clean`` (the job ends normally on every rank): first wait until every rank is here, so that no rank leaves
    while a peer still talks to it. The group's C++ state (gloo pairs and their threads, NCCL communicators) is
    never torn down: destroying it, or letting the interpreter's exit destroy it, aborted ranks with "terminate
    called without an active exception" (SIGABRT, exit -6) in CI, after an error (a peer gone or mid-collective)
    and also once after a run that had finished on every rank. Ending the process releases it all."""
    global _EXIT_WITHOUT_TEARDOWN
    if world.distributed:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if clean:
            world.barrier(idle=True, what="leaving the process group")
        _EXIT_WITHOUT_TEARDOWN = True


def exit_process(code: int) -> NoReturn:
    """``sys.exit(code)``, or, after a distributed run (:func:`close_world`), output flushed and ``os._exit(code)``:
    the process group's C++ state is not torn down, so the status is ``code``, never -6."""
    if _EXIT_WITHOUT_TEARDOWN:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)

