"""A CPU stand-in for ``torch.distributed`` with NCCL's matching and ordering rules (test helper).

``NcclSim(world).run(fn)`` runs ``fn(rank)`` for every rank in its own thread, with the module
``dist`` that the runtime's communication code uses (``attention.comm`` and ``attention.groups``)
replaced by this simulator. The rules it enforces are NCCL's, as PyTorch's ProcessGroupNCCL exposes
them:

- one stream per (rank, communicator): an operation (a ``batch_isend_irecv`` batch or a collective)
  starts only when every earlier operation of that rank on that communicator has finished;
- P2P messages are matched per (communicator, src, dst) in posting order; tags are ignored. A
  matched pair whose shapes or dtypes differ is an error; so is one whose tags differ (the runtime's
  tags name the logical message, so under NCCL's rule the receiver would get another message's data);
- a communicator exists only once every member has posted its first operation on it (lazy
  creation: no member's first operation starts before all members have posted theirs);
- a batch finishes when all its messages have been transferred, a collective when every member is
  running it (the k-th collective of every member on that communicator; kinds and splits must agree);
- ``work.wait()`` blocks the calling rank (stricter than NCCL's stream wait, with the same
  dependencies: nothing the rank posts later can run before the awaited operation);
- backends (``NcclSim(world, backend=...)`` for the default group and every ``new_group`` without
  one; ``new_group(backend="gloo")`` for a side group): a group created with ``"nccl"`` rejects CPU
  tensors in P2P and collectives as ProcessGroupNCCL does ("No backend type associated with device
  type cpu"; tests stand in for CUDA tensors with ``meta`` ones); a ``"gloo"`` group is created
  eagerly, so ``new_group`` blocks until every member has called it (gloo connects its members at
  creation); ``None`` (the default) checks no device: CPU tensors stand in for CUDA tensors, as the
  attention runtime's tests use them. ``broadcast_object_list`` works on every backend (PyTorch
  moves the pickled bytes to the current CUDA device for NCCL).
If every live rank is blocked, that is a deadlock: every rank gets ``SimError`` naming what each one
waits for. ``run`` returns each rank's result or raises the first error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist


class SimError(RuntimeError):
    pass


class SimGroup:
    """A communicator over global ranks (what ``dist.new_group`` returns)."""

    def __init__(self, gid: int, ranks: tuple[int, ...], backend: str | None = None) -> None:
        self.id, self.ranks, self.backend = gid, ranks, backend
        self.first_posted: set[int] = set()

    @property
    def ready(self) -> bool:
        return len(self.first_posted) == len(self.ranks)

    def __repr__(self) -> str:
        return f"group{self.id}{list(self.ranks)}"


@dataclass
class _Msg:
    op: _Op
    tensor: torch.Tensor
    tag: int
    is_send: bool
    key: tuple[int, int, int]  # (communicator, src, dst)
    index: int  # position among the messages of that key and direction
    done: bool = False


@dataclass
class _Op:
    rank: int
    group: SimGroup
    kind: str  # "batch" or a collective name
    msgs: list[_Msg] = field(default_factory=list)
    payload: Any = None  # collectives: (output, input, splits...)
    seq: int = 0  # collectives: k-th collective of this rank on this group
    done: bool = False

    def describe(self) -> str:
        if self.kind == "batch":
            return f"a P2P batch on {self.group} ({len(self.msgs)} messages)"
        return f"{self.kind} #{self.seq} on {self.group}"


class P2POp:
    def __init__(
        self,
        op: Callable,
        tensor: torch.Tensor,
        peer: int,
        group: SimGroup | None = None,
        tag: int = 0,
    ) -> None:
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def isend(
    *args: Any, **kwargs: Any
) -> None:  # markers, as torch.distributed.isend / irecv in P2POp
    raise AssertionError("use batch_isend_irecv")


def irecv(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("use batch_isend_irecv")


class _Work:
    def __init__(self, sim: NcclSim, op: _Op) -> None:
        self.sim, self.op = sim, op

    def wait(self) -> bool:
        self.sim._wait(self.op)
        return True


class NcclSim:
    """See the module docstring. Counters: ``batches``, ``messages`` (all ranks)."""

    def __init__(self, world: int, *, backend: str | None = None) -> None:
        self.world, self.backend = world, backend
        self.cond = threading.Condition()
        self.local = threading.local()
        self.groups: list[SimGroup] = []
        self.streams: dict[tuple[int, int], list[_Op]] = {}
        self.sends: dict[tuple[int, int, int], list[_Msg]] = {}
        self.recvs: dict[tuple[int, int, int], list[_Msg]] = {}
        self.coll_seq: dict[tuple[int, int], int] = {}
        self.blocked: dict[int, _Op] = {}
        self.alive = 0
        self.error: str | None = None
        self.batches = self.messages = 0
        self.world_group = SimGroup(-1, tuple(range(world)), backend)
        self.world_group.first_posted = set(range(world))  # the default group exists already
        self.group = SimpleNamespace(WORLD=self.world_group)

    # ---- the torch.distributed surface the runtime uses ----------------------------------------
    P2POp = P2POp
    ReduceOp = dist.ReduceOp
    isend = staticmethod(isend)
    irecv = staticmethod(irecv)

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_backend(self, group: SimGroup | None = None) -> str:
        return str((group or self.world_group).backend)

    def get_global_rank(self, group: SimGroup, group_rank: int) -> int:
        return group.ranks[group_rank]

    def get_process_group_ranks(self, group: SimGroup) -> list[int]:
        return list(group.ranks)

    def get_rank(self, group: SimGroup | None = None) -> int:
        me = self.local.rank
        if group is None:
            return me
        return group.ranks.index(me) if me in group.ranks else -1

    def get_world_size(self, group: SimGroup | None = None) -> int:
        return self.world if group is None else len(group.ranks)

    def new_group(
        self, ranks: list[int] | None = None, backend: str | None = None, **kwargs: Any
    ) -> SimGroup:
        ranks = list(range(self.world)) if ranks is None else ranks
        backend = backend or self.backend
        with self.cond:
            k = self.local.groups_made
            self.local.groups_made += 1
            if k == len(self.groups):
                self.groups.append(SimGroup(k, tuple(sorted(ranks)), backend))
            g = self.groups[k]
            if g.ranks != tuple(sorted(ranks)) or g.backend != backend:
                self._fail(
                    f"rank {self.local.rank}: new_group call {k} has ranks {sorted(ranks)} "
                    f"({backend}), another rank created {list(g.ranks)} ({g.backend}) "
                    "(new_group calls out of order)"
                )
        if backend == "gloo" and self.local.rank in g.ranks:
            self._collective("create", g, ())  # gloo connects every member at creation
        return g

    def batch_isend_irecv(self, ops: list[P2POp]) -> list[_Work]:
        me = self.local.rank
        group = ops[0].group or self.world_group
        if any((o.group or self.world_group) is not group for o in ops):
            raise SimError("one batch spans several communicators")
        with self.cond:
            self._check_devices(me, group, "batch_isend_irecv", [o.tensor for o in ops])
            op = self._post(me, group, "batch")
            for o in ops:
                is_send = o.op is isend
                key = (group.id, me, o.peer) if is_send else (group.id, o.peer, me)
                fifo = (self.sends if is_send else self.recvs).setdefault(key, [])
                msg = _Msg(op, o.tensor, o.tag, is_send, key, len(fifo))
                fifo.append(msg)
                op.msgs.append(msg)
                self.messages += is_send
            self.batches += 1
            self._progress()
        return [_Work(self, op)]

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        group: SimGroup | None = None,
    ) -> None:
        self._collective(
            "all_to_all",
            group,
            (output, input, list(output_split_sizes), list(input_split_sizes)),
            tensors=(output, input),
        )

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: SimGroup | None = None,
        **kwargs: Any,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            raise SimError(f"all_reduce: the simulator implements SUM and MAX, got {op}")
        self._collective("all_reduce", group, (tensor, op), tensors=(tensor,))

    def broadcast_object_list(
        self, object_list: list[Any], src: int = 0, group: SimGroup | None = None, **kwargs: Any
    ) -> None:
        """``src`` is a global rank, as in ``torch.distributed``."""
        self._collective("broadcast_object_list", group, (object_list, src))

    # ---- running ranks -----------------------------------------------------------------------
    def run(self, fn: Callable[[int], Any], *, timeout_s: float = 120.0) -> list[Any]:
        results: list[Any] = [None] * self.world
        errors: list[BaseException | None] = [None] * self.world

        def main(rank: int) -> None:
            self.local.rank, self.local.groups_made = rank, 0
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # reported below  # noqa: BLE001
                errors[rank] = e
                with self.cond:
                    if self.error is None and not isinstance(e, SimError):
                        self._fail(f"rank {rank} raised {type(e).__name__}: {e}")
            finally:
                with self.cond:
                    self.alive -= 1
                    self._check_deadlock()
                    self.cond.notify_all()

        threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(self.world)]
        self.alive = self.world
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
            if t.is_alive():
                with self.cond:
                    self._fail(f"a rank is still running after {timeout_s} s")
                raise SimError(self.error)
        if self.error is not None:
            raise SimError(self.error)
        return results

    # ---- internals (call with self.cond held) ------------------------------------------------
    def _post(self, me: int, group: SimGroup, kind: str) -> _Op:
        if self.error is not None:
            raise SimError(self.error)
        if me not in group.ranks:
            raise SimError(f"rank {me} posts on {group}, which it is not a member of")
        op = _Op(me, group, kind)
        group.first_posted.add(me)
        self.streams.setdefault((me, group.id), []).append(op)
        return op

    def _check_devices(
        self, me: int, group: SimGroup, call: str, tensors: Sequence[torch.Tensor]
    ) -> None:
        """ProcessGroupNCCL has no CPU backend: a CPU tensor on an NCCL group is an error."""
        if group.backend == "nccl" and any(t.device.type == "cpu" for t in tensors):
            self._fail(
                f"rank {me}: {call} on {group} (nccl) with a CPU tensor: No backend type "
                "associated with device type cpu"
            )
            raise SimError(self.error)

    def _collective(
        self,
        kind: str,
        group: SimGroup | None,
        payload: Any,
        *,
        tensors: tuple[torch.Tensor, ...] = (),
    ) -> None:
        group = group or self.world_group
        me = self.local.rank
        with self.cond:
            self._check_devices(me, group, kind, tensors)
            op = self._post(me, group, kind)
            op.payload = payload
            op.seq = self.coll_seq.get((me, group.id), 0)
            self.coll_seq[(me, group.id)] = op.seq + 1
            self._progress()
        self._wait(op)

    def _active(self, op: _Op) -> bool:
        if op.done or not op.group.ready:
            return False
        stream = self.streams[(op.rank, op.group.id)]
        return next(o for o in stream if not o.done) is op

    def _progress(self) -> None:
        changed = True
        while changed and self.error is None:
            changed = False
            for stream in list(self.streams.values()):
                op = next((o for o in stream if not o.done), None)
                if op is None or not self._active(op):
                    continue
                if op.kind == "batch":
                    changed |= self._advance_batch(op)
                else:
                    changed |= self._advance_collective(op)

    def _advance_batch(self, op: _Op) -> bool:
        changed = False
        for msg in op.msgs:
            if msg.done:
                continue
            others = (self.recvs if msg.is_send else self.sends).get(msg.key, [])
            theirs = others[msg.index] if msg.index < len(others) else None
            if theirs is None or not self._active(theirs.op):
                continue
            send, recv = (msg, theirs) if msg.is_send else (theirs, msg)
            if send.tensor.shape != recv.tensor.shape or send.tensor.dtype != recv.tensor.dtype:
                self._fail(
                    f"P2P mismatch on {op.group}: rank {send.op.rank} sends {tuple(send.tensor.shape)} "
                    f"{send.tensor.dtype} (tag {send.tag}) where rank {recv.op.rank} receives "
                    f"{tuple(recv.tensor.shape)} {recv.tensor.dtype} (tag {recv.tag})"
                )
                return False
            if send.tag != recv.tag:
                self._fail(
                    f"P2P order mismatch on {op.group}: rank {recv.op.rank} receives message tag "
                    f"{send.tag} from rank {send.op.rank} where it expects tag {recv.tag}"
                )
                return False
            recv.tensor.copy_(send.tensor)
            send.done = recv.done = changed = True
        if all(m.done for m in op.msgs) and not op.done:
            op.done = changed = True
        return changed

    def _advance_collective(self, op: _Op) -> bool:
        members = []
        for r in op.group.ranks:
            stream = self.streams.get((r, op.group.id), [])
            head = next((o for o in stream if not o.done), None)
            if head is None or not self._active(head) or head.kind == "batch":
                return False
            if head.kind != op.kind or head.seq != op.seq:
                self._fail(
                    f"collective mismatch on {op.group}: rank {op.rank} runs {op.describe()}, rank {r} "
                    f"runs {head.describe()}"
                )
                return False
            members.append(head)
        if op.kind == "all_reduce":
            values = torch.stack([m.payload[0].clone() for m in members])
            total = values.amax(0) if op.payload[1] == dist.ReduceOp.MAX else values.sum(0)
            for m in members:
                m.payload[0].copy_(total)
        elif op.kind == "broadcast_object_list":
            source = next(m for m in members if m.rank == op.payload[1])
            for m in members:
                m.payload[0][:] = list(source.payload[0])
        elif op.kind == "create":
            pass
        else:
            for i, mi in enumerate(members):  # member i receives chunk i of every member j
                out, _, out_splits, _ = mi.payload
                pieces = []
                for j, mj in enumerate(members):
                    _, inp, _, in_splits = mj.payload
                    if in_splits[i] != out_splits[j]:
                        self._fail(
                            f"all_to_all split mismatch on {op.group}: rank {mj.rank} sends "
                            f"{in_splits[i]} to rank {mi.rank}, which expects {out_splits[j]}"
                        )
                        return False
                    start = sum(in_splits[:i])
                    pieces.append(inp[start : start + in_splits[i]])
                out.copy_(torch.cat(pieces) if pieces else out)
        for m in members:
            m.done = True
        return True

    def _wait(self, op: _Op) -> None:
        with self.cond:
            while not op.done:
                if self.error is not None:
                    raise SimError(self.error)
                self.blocked[op.rank] = op
                self._check_deadlock()
                if self.error is None:
                    self.cond.wait(1.0)
                self.blocked.pop(op.rank, None)
            self.cond.notify_all()

    def _check_deadlock(self) -> None:
        if self.error is None and self.alive > 0 and len(self.blocked) == self.alive:
            self._progress()
            if any(o.done for o in self.blocked.values()):
                return  # a blocked rank can go on: it wakes on notify
            waits = "; ".join(
                f"rank {r} waits for {o.describe()}"
                + (
                    ""
                    if o.group.ready
                    else f" (members {sorted(set(o.group.ranks) - o.group.first_posted)} "
                    "never joined its first operation)"
                )
                for r, o in sorted(self.blocked.items())
                if not o.done
            )
            self._fail(f"deadlock: {waits}")

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
        self.cond.notify_all()
