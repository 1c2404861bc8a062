"""Point-to-point activations and gradients between pipeline stages, in a deadlock-free order.

Every rank knows every rank's action list (schedules are data), so every rank can run the same
:func:`tpfuse.pipeline.simulate.simulate` and learn, for each message (an activation from virtual
stage s to s + 1 or a gradient from s to s − 1), the simulated time it is sent. From that each
rank derives one total order of *all* the messages it sends or receives: by (send time, sender's
pp rank, sender's position). Both ends of every message compute the same key, so:

1. **No swapped tensors.** Each rank issues its p2p operations strictly in that order: before
   sending message X it posts (non-blocking) receives for every earlier message addressed to it;
   before waiting for message Y it posts receives up to Y; and after each operation it posts at
   once the receives that follow it in the order up to the next send (as Megatron pairs a send
   with the next receive), so a peer's message can arrive while this rank computes — the order
   itself is unchanged. So on each pair of ranks the k-th send
   of one side and the k-th receive of the other are the same message, which is what an
   order-matched transport needs (NCCL p2p; gloo with one tag). Megatron's batched exchange at
   pp = 2 with interleaving, where the previous and next rank are the same peer, goes wrong
   exactly here; in this order there is nothing to confuse — one sequence per peer.
2. **No deadlock.** Sends are ``isend`` (never block the caller), receives are ``irecv`` posted
   ahead; the only blocking call is waiting for a specific message Y. Every operation a rank
   must issue before Y is either a receive (non-blocking) or a send it has already made: if a send
   X were ordered before Y but not yet made, X's producing action would come after Y's consuming
   action in the rank's list, and then time(Y) ≤ start(consumer) < end(producer) = time(X)
   (every action costs > 0 in the simulation), contradicting X before Y. So a wait on Y only
   waits for the sender to compute Y, which only waits on messages with smaller simulated time:
   the wait-for relation strictly decreases simulated time and cannot cycle. The simulation
   reports a deadlock for an invalid schedule before any communication happens.
   With one in-order stream per rank (or per pair) the same argument holds: the globally
   earliest unfinished message is at the head of both its sender's and receiver's streams.
3. **Receiving ahead on gloo** (``recv_ahead``). A gloo send writes its payload at once, from
   the caller, only when the receiver's "receive posted" notice has already reached the sender;
   otherwise the payload waits for the sender's transport thread to see that notice, which on a
   busy CPU costs milliseconds per message. A posted gloo receive holds up nothing, and gloo
   matches the k-th send with the k-th receive per pair of ranks, so receives may be posted past
   this rank's own pending sends as long as each peer's receives keep their order: with
   ``recv_ahead`` = N > 0, after each operation further receives (in the order, skipping sends)
   are posted while fewer than N are outstanding, which costs up to N buffers of
   ``tensor_shape``. Sends keep the strict order, so 1. and 2. are unchanged. On NCCL a receive
   is queued on the pair's stream and blocks the send behind it, hence N = 0 there
   (:func:`recv_ahead_for`).

The order depends only on the schedule, so the executor takes it from the cached
:func:`tpfuse.pipeline.plan.rank_plan` (computed once per configuration); a step then costs O(1)
per operation: the executor addresses messages by their index in the order.

The sent tensor is a detached alias of the output, so the caller may then free the output's
storage (Megatron's deallocation): the alias keeps the memory alive until the send completes.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from tpfuse.parallel.checks import check_non_negative_int
from tpfuse.parallel.host_staging import backend_family

from .plan import message_orders
from .simulate import Message, simulate

GLOO_RECV_AHEAD = 4   # recv_ahead_for's default on gloo: the benchmarks' gain flattens beyond


def recv_ahead_for(requested: int | None, backend: str) -> int:
    """The receive-ahead depth for a pp group on ``backend`` (a ``dist.get_backend`` name):
    ``requested`` (a config's ``p2p_recv_ahead``) or, when None, GLOO_RECV_AHEAD on gloo and 0
    elsewhere. ValueError for a depth > 0 off gloo (see 3. above)."""
    if requested is None:
        return GLOO_RECV_AHEAD if backend_family(backend) == "gloo" else 0
    check_non_negative_int("p2p_recv_ahead", requested)   # configs that skip validate() too
    if requested > 0 and backend_family(backend) != "gloo":
        raise ValueError(f"p2p_recv_ahead={requested} needs the gloo backend, the pipeline group "
                         f"uses {backend!r} (a posted receive there blocks the sends behind it); "
                         f"set it to 0 or leave it unset")
    return requested


def message_order(schedule: list, pp_rank: int, num_microbatches: int, vpp_size: int) -> list:
    """Every message pp rank ``pp_rank`` sends or receives, in the order it issues them (for any
    explicit schedule; the executor's schedules come cached from :mod:`tpfuse.pipeline.plan`)."""
    result = simulate(schedule, num_microbatches, vpp_size, analyze_reorders=False)
    return message_orders(result, len(schedule))[pp_rank]


class PipelineP2P:
    """This rank's p2p traffic for one run of a schedule (one optimizer step).

    ``messages``: this rank's message order (a :class:`~tpfuse.pipeline.plan.RankPlan`'s
    ``messages``), ``position`` its index; ``pp_ranks``: global ranks of the pipeline group in
    pp-rank order; ``group``: its ProcessGroup. All messages share ``tensor_shape`` / ``dtype`` /
    ``device``. ``recv_ahead``: receives that may be outstanding past this rank's pending sends
    (3. above; 0: the strict order). Per step the object costs O(1) to build and O(1) per
    operation.
    """

    def __init__(self, messages, position, pp_rank: int, pp_ranks: list, group, tensor_shape,
                 dtype=torch.float32, device="cpu", recv_ahead: int = 0):
        self.pp_size = len(pp_ranks)
        self.pp_rank = pp_rank
        self.pp_ranks = list(pp_ranks)
        self.group = group
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self._order = messages
        self._position = position
        self.recv_ahead = recv_ahead
        self._cursor = 0                # next operation to issue in self._order
        self._scanned = 0               # receives in self._order[:_scanned] are posted
        self._pending_recvs: dict = {}  # index -> (work, buffer)
        self._pending_sends: deque = deque()  # (work, tensor alias kept alive until done)

    @classmethod
    def for_schedule(cls, schedule: list, pp_rank: int, pp_ranks: list, group,
                     num_microbatches: int, vpp_size: int, tensor_shape, dtype=torch.float32,
                     device="cpu", recv_ahead: int = 0) -> "PipelineP2P":
        """For an explicit (uncached) schedule; ValueError if it deadlocks."""
        order = message_order(schedule, pp_rank, num_microbatches, vpp_size)
        position = {message: i for i, message in enumerate(order)}
        return cls(order, position, pp_rank, pp_ranks, group, tensor_shape, dtype, device,
                   recv_ahead)

    def _rank_of(self, stage: int) -> int:
        return stage % self.pp_size

    def _post_receives_before(self, index: int) -> None:
        """Issue every operation before ``index``; only receives may still be outstanding."""
        while self._cursor < index:
            if not self._is_receive(self._cursor):
                raise RuntimeError(f"pp rank {self.pp_rank}: p2p order violated, "
                                   f"{self._order[self._cursor]} must be sent before later "
                                   f"messages are handled")
            if self._cursor >= self._scanned:
                self._post_receive(self._cursor)
            self._cursor += 1

    def _is_receive(self, index: int) -> bool:
        return self._rank_of(self._order[index].dst_stage) == self.pp_rank

    def _post_receive(self, index: int) -> None:
        message = self._order[index]
        buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
        src = self.pp_ranks[self._rank_of(message.src_stage)]
        self._pending_recvs[index] = (dist.irecv(buffer, src=src, group=self.group), buffer)

    def _index_of(self, message: Message) -> int:
        if message not in self._position:
            raise RuntimeError(f"pp rank {self.pp_rank}: {message} is not in this schedule")
        return self._position[message]

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        """Non-blocking send of ``tensor`` (an activation or gradient) as ``message``."""
        self.send_at(self._index_of(message), tensor)

    def recv(self, message: Message) -> torch.Tensor:
        """Wait for ``message`` (posting receives up to it first) and return its tensor."""
        return self.recv_at(self._index_of(message))

    def send_at(self, index: int, tensor: torch.Tensor) -> None:
        """``send`` of the message at ``index`` of this rank's order."""
        message = self._order[index]
        if tuple(tensor.shape) != self.tensor_shape:
            raise ValueError(f"{message}: tensor shape {tuple(tensor.shape)} differs from the "
                             f"pipeline tensor_shape {self.tensor_shape}")
        self._post_receives_before(index)
        if self._cursor != index:
            raise RuntimeError(f"pp rank {self.pp_rank}: {message} sent twice")
        alias = tensor.detach().to(self.dtype).contiguous()
        dst = self.pp_ranks[self._rank_of(message.dst_stage)]
        self._pending_sends.append((dist.isend(alias, dst=dst, group=self.group), alias))
        self._cursor += 1
        self._drop_completed_sends()
        self._post_receives_ahead()

    def recv_at(self, index: int) -> torch.Tensor:
        """``recv`` of the message at ``index`` of this rank's order."""
        self._post_receives_before(index + 1)
        self._post_receives_ahead()
        work, buffer = self._pending_recvs.pop(index)
        work.wait()
        return buffer

    def _post_receives_ahead(self) -> None:
        """Post the receives that come next in the order, up to the next send: the same
        operations in the same order, issued early, so a peer's message can land while this
        rank computes (buffers for at most the receives before one send). Then, while fewer
        than ``recv_ahead`` are outstanding, the receives after that send (3. above)."""
        end = self._cursor
        while end < len(self._order) and self._is_receive(end):
            end += 1
        self._post_receives_before(end)
        scan = max(self._scanned, self._cursor)   # then past the next send, on gloo (3.)
        while scan < len(self._order) and len(self._pending_recvs) < self.recv_ahead:
            if self._is_receive(scan):
                self._post_receive(scan)
            scan += 1
        self._scanned = scan

    def _drop_completed_sends(self) -> None:
        """Release the aliases of finished sends (oldest first: sends complete in order)."""
        while self._pending_sends and self._pending_sends[0][0].is_completed():
            self._pending_sends.popleft()

    def finish(self) -> None:
        """Wait for every send; every message of the schedule must have been handled."""
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()
        if self._cursor != len(self._order) or self._pending_recvs:
            missing = list(self._order[self._cursor:]) + [self._order[i]
                                                          for i in self._pending_recvs]
            raise RuntimeError(f"pp rank {self.pp_rank}: {len(missing)} p2p message(s) never "
                               f"handled, first {missing[0]}")
