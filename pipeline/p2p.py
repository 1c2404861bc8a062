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

4. **Variable sequence lengths** (``variable_seq_lengths``, Megatron's flag). Every message is
   then two sends on the same stream: its shape, three int64 (Megatron's ``_communicate_shapes``),
   and the tensor. A receive posts the shape's receive; the tensor's receive is posted once that
   shape is in, and before anything later in the order is issued, so the k-th operation of each
   side of a link is still the same one. Posting the next operation thus may wait for a shape —
   but only for a receive ordered before every send not yet made, which is the wait of 2. and
   cannot deadlock. The receives posted ahead (after each operation, up to the next send) are
   posted only while the shapes before them have arrived, so they never wait; receiving past a
   pending send (3.) would wait on a message that may need that send, so ``recv_ahead`` is 0
   with variable lengths (:func:`recv_ahead_for`). Without the flag every message has
   ``tensor_shape``, and a tensor whose sequence dimension differs is refused before it is sent,
   naming the flag.

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
SHAPE_DIMS = 3        # a message's shape header: (sequence, micro-batch, hidden), as Megatron's


def recv_ahead_for(requested: int | None, backend: str, variable_seq_lengths: bool = False) -> int:
    """The receive-ahead depth for a pp group on ``backend`` (a ``dist.get_backend`` name):
    ``requested`` (a config's ``p2p_recv_ahead``) or, when None, GLOO_RECV_AHEAD on gloo and 0
    elsewhere; 0 with ``variable_seq_lengths`` (4. above). ValueError for a depth > 0 off gloo
    (see 3. above) or with variable lengths."""
    if variable_seq_lengths:
        if requested:
            raise ValueError(f"p2p_recv_ahead={requested} with variable_seq_lengths=True: a "
                             f"receive needs its shape first, so receives keep the strict order; "
                             f"set p2p_recv_ahead to 0 or leave it unset")
        return 0
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
    (3. above; 0: the strict order). With ``variable_seq_lengths`` each message's shape travels
    ahead of it (4. above) and ``tensor_shape`` is unused (None allowed). Per step the object
    costs O(1) to build and O(1) per operation.
    """

    def __init__(self, messages, position, pp_rank: int, pp_ranks: list, group, tensor_shape,
                 dtype=torch.float32, device="cpu", recv_ahead: int = 0,
                 variable_seq_lengths: bool = False):
        if variable_seq_lengths and recv_ahead:
            raise ValueError(f"recv_ahead={recv_ahead} with variable_seq_lengths=True: receives "
                             f"keep the strict order (a receive needs its shape first)")
        if tensor_shape is None and not variable_seq_lengths:
            raise ValueError("tensor_shape is required unless variable_seq_lengths=True")
        self.pp_size = len(pp_ranks)
        self.pp_rank = pp_rank
        self.pp_ranks = list(pp_ranks)
        self.group = group
        self.variable_seq_lengths = bool(variable_seq_lengths)
        self.tensor_shape = None if tensor_shape is None else tuple(tensor_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self._order = messages
        self._position = position
        self.recv_ahead = recv_ahead
        self._cursor = 0                # next operation to issue in self._order
        self._scanned = 0               # receives in self._order[:_scanned] are posted
        self._pending_recvs: dict = {}  # index -> (work, buffer)
        self._pending_sends: deque = deque()  # (work, tensor alias kept alive until done)
        self._awaiting_shape = None     # variable lengths: (index, work, header, src) posted last

    @classmethod
    def for_schedule(cls, schedule: list, pp_rank: int, pp_ranks: list, group,
                     num_microbatches: int, vpp_size: int, tensor_shape, dtype=torch.float32,
                     device="cpu", recv_ahead: int = 0,
                     variable_seq_lengths: bool = False) -> "PipelineP2P":
        """For an explicit (uncached) schedule; ValueError if it deadlocks."""
        order = message_order(schedule, pp_rank, num_microbatches, vpp_size)
        position = {message: i for i, message in enumerate(order)}
        return cls(order, position, pp_rank, pp_ranks, group, tensor_shape, dtype, device,
                   recv_ahead, variable_seq_lengths)

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
        src = self.pp_ranks[self._rank_of(message.src_stage)]
        if self.variable_seq_lengths:   # the shape first; the tensor once it is in (4. above)
            self._settle_shape()
            header = torch.empty((SHAPE_DIMS,), dtype=torch.int64, device=self.device)
            self._awaiting_shape = (index, dist.irecv(header, src=src, group=self.group), header,
                                    src)
            return
        buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
        self._pending_recvs[index] = (dist.irecv(buffer, src=src, group=self.group), buffer)

    def _shape_arrived(self) -> bool:
        """No receive waits for its shape (or the one that does has it): posting on is free."""
        return self._awaiting_shape is None or self._awaiting_shape[1].is_completed()

    def _settle_shape(self) -> None:
        """Variable lengths: wait for the shape of the receive posted last, then post the
        receive of its tensor (before any later operation, so both sides keep one order)."""
        if self._awaiting_shape is None:
            return
        index, work, header, src = self._awaiting_shape
        self._awaiting_shape = None
        work.wait()
        buffer = torch.empty(tuple(header.tolist()), dtype=self.dtype, device=self.device)
        self._pending_recvs[index] = (dist.irecv(buffer, src=src, group=self.group), buffer)

    def _send_shape(self, index: int, tensor: torch.Tensor) -> None:
        """Variable lengths: the shape of the message at ``index`` ahead of its tensor."""
        header = torch.tensor(tensor.shape, dtype=torch.int64, device=self.device)
        dst = self.pp_ranks[self._rank_of(self._order[index].dst_stage)]
        self._pending_sends.append((dist.isend(header, dst=dst, group=self.group), header))

    def _check_shape(self, message: Message, tensor: torch.Tensor) -> None:
        shape = tuple(tensor.shape)
        if self.variable_seq_lengths:
            if len(shape) != SHAPE_DIMS:
                raise ValueError(f"{message}: tensor shape {shape} is not (sequence, micro-batch, "
                                 f"hidden); variable_seq_lengths sends {SHAPE_DIMS}-d shapes")
            return
        expected = self.tensor_shape
        if (shape != expected and len(shape) == len(expected) and shape[1:] == expected[1:]):
            raise ValueError(f"{message}: sequence length {shape[0]} differs from the pipeline's "
                             f"{expected[0]} (tensor shape {shape}, pipeline tensor_shape "
                             f"{expected}): micro-batches of other lengths than --seq-length need "
                             f"--variable-seq-lengths (variable_seq_lengths=True), which sends "
                             f"each tensor's shape ahead of it")
        if shape != expected:
            raise ValueError(f"{message}: tensor shape {shape} differs from the "
                             f"pipeline tensor_shape {expected}")

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
        self._check_shape(message, tensor)
        self._post_receives_before(index)
        if self._cursor != index:
            raise RuntimeError(f"pp rank {self.pp_rank}: {message} sent twice")
        alias = tensor.detach().to(self.dtype).contiguous()
        dst = self.pp_ranks[self._rank_of(message.dst_stage)]
        if self.variable_seq_lengths:
            self._settle_shape()
            self._send_shape(index, alias)
        self._pending_sends.append((dist.isend(alias, dst=dst, group=self.group), alias))
        self._cursor += 1
        self._drop_completed_sends()
        self._post_receives_ahead()

    def recv_at(self, index: int) -> torch.Tensor:
        """``recv`` of the message at ``index`` of this rank's order."""
        self._post_receives_before(index + 1)
        self._post_receives_ahead()
        if index not in self._pending_recvs:    # variable lengths: its shape is still due
            self._settle_shape()
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
        if self.variable_seq_lengths:
            self._post_receives_with_shapes_in(end)
            return
        self._post_receives_before(end)
        scan = max(self._scanned, self._cursor)   # then past the next send, on gloo (3.)
        while scan < len(self._order) and len(self._pending_recvs) < self.recv_ahead:
            if self._is_receive(scan):
                self._post_receive(scan)
            scan += 1
        self._scanned = scan

    def _post_receives_with_shapes_in(self, end: int) -> None:
        """Variable lengths: post the receives before ``end`` while every shape before them has
        arrived, and the tensor receive of one whose shape has (never waits)."""
        while self._cursor < end and self._shape_arrived():
            self._post_receive(self._cursor)
            self._cursor += 1
        if self._awaiting_shape is not None and self._shape_arrived():
            self._settle_shape()

    def _drop_completed_sends(self) -> None:
        """Release the aliases of finished sends (oldest first: sends complete in order)."""
        while self._pending_sends and self._pending_sends[0][0].is_completed():
            self._pending_sends.popleft()

    def finish(self) -> None:
        """Wait for every send; every message of the schedule must have been handled."""
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()
        awaiting = [] if self._awaiting_shape is None else [self._awaiting_shape[0]]
        if self._cursor != len(self._order) or self._pending_recvs or awaiting:
            missing = list(self._order[self._cursor:]) + [self._order[i] for i in
                                                          [*self._pending_recvs, *awaiting]]
            raise RuntimeError(f"pp rank {self.pp_rank}: {len(missing)} p2p message(s) never "
                               f"handled, first {missing[0]}")
