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
  dependencies: nothing the rank posts later can run before the awaited operation).
If every live rank is blocked, that is a deadlock: every rank gets ``SimError`` naming what each one
waits for. ``run`` returns each rank's result or raises the first error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class SimError(RuntimeError):
    pass


class SimGroup:
    """A communicator over global ranks (what ``dist.new_group`` returns)."""

    def __init__(self, gid: int, ranks: tuple[int, ...]) -> None:
        self.id, self.ranks = gid, ranks
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

    def __init__(self, world: int) -> None:
        self.world = world
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
        self.world_group = SimGroup(-1, tuple(range(world)))
        self.world_group.first_posted = set(range(world))  # the default group exists already

    # ---- the torch.distributed surface the runtime uses ----------------------------------------
    P2POp = P2POp
    isend = staticmethod(isend)
    irecv = staticmethod(irecv)

    def get_rank(self, group: SimGroup | None = None) -> int:
        me = self.local.rank
        if group is None:
            return me
        return group.ranks.index(me) if me in group.ranks else -1

    def get_world_size(self, group: SimGroup | None = None) -> int:
        return self.world if group is None else len(group.ranks)

    def new_group(self, ranks: list[int], **kwargs: Any) -> SimGroup:
        with self.cond:
            k = self.local.groups_made
            self.local.groups_made += 1
            if k == len(self.groups):
                self.groups.append(SimGroup(k, tuple(sorted(ranks))))
            g = self.groups[k]
            if g.ranks != tuple(sorted(ranks)):
                self._fail(
                    f"rank {self.local.rank}: new_group call {k} has ranks {sorted(ranks)}, another rank "
                    f"created {list(g.ranks)} (new_group calls out of order)"
                )
            return g

    def batch_isend_irecv(self, ops: list[P2POp]) -> list[_Work]:
        me = self.local.rank
        group = ops[0].group or self.world_group
        if any((o.group or self.world_group) is not group for o in ops):
            raise SimError("one batch spans several communicators")
        with self.cond:
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
            "all_to_all", group, (output, input, list(output_split_sizes), list(input_split_sizes))
        )

    def all_reduce(
        self, tensor: torch.Tensor, group: SimGroup | None = None, **kwargs: Any
    ) -> None:
        self._collective("all_reduce", group, (tensor,))

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

    def _collective(self, kind: str, group: SimGroup | None, payload: Any) -> None:
        group = group or self.world_group
        me = self.local.rank
        with self.cond:
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
            total = sum(m.payload[0].clone() for m in members)
            for m in members:
                m.payload[0].copy_(total)
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
