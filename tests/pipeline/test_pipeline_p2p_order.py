"""The p2p issue order of tpfuse.pipeline.p2p, checked without processes.

``torch.distributed`` is replaced by a recorder; every rank's PipelineP2P is driven through its
action list exactly as the executor does (receive before a forward/backward that needs input,
send after one that produces output). Checked for every valid (p, m, v, g) with p ≤ 4, m ≤ 8,
v ≤ 3, forward-and-backward and forward-only: no rank ever has to issue an operation out of
order (PipelineP2P raises then), and on every pair of ranks the k-th operation of one side is
the k-th operation of the other — the same message, one sending, one receiving — which is what
an order-matched transport (NCCL, gloo with one tag) needs to neither swap tensors nor hang.
"""
import itertools

import pytest
import torch

import tpfuse.pipeline.p2p as p2p_module
from tpfuse.pipeline.p2p import PipelineP2P
from tpfuse.pipeline.schedules import build_schedule, forward_only
from tpfuse.pipeline.simulate import Message

SHAPE = (1,)


class _Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


class _Recorder:
    """Stands in for torch.distributed: logs (op, peer pp rank, message) per rank, and after
    each action the number of receives posted and not yet waited for."""

    def __init__(self):
        self.current = None   # the PipelineP2P issuing operations now
        self.receiving = None  # the order index of the receive being posted
        self.log = {}
        self.outstanding = {}

    def _record(self, op, peer):
        comm = self.current
        message = comm._order[self.receiving if op == "recv" else comm._cursor]
        self.log.setdefault(comm.pp_rank, []).append((op, peer, message))
        return _Done()

    def isend(self, tensor, dst, group):
        return self._record("send", dst)

    def irecv(self, tensor, src, group):
        return self._record("recv", src)


def _recording(monkeypatch):
    """A fresh recorder in place of torch.distributed, told the index of each receive posted."""
    recorder, post = _Recorder(), PipelineP2P._post_receive

    def post_recorded(comm, index):
        recorder.receiving = index
        post(comm, index)

    monkeypatch.setattr(p2p_module, "dist", recorder)
    monkeypatch.setattr(PipelineP2P, "_post_receive", post_recorded)
    return recorder


def _drive(recorder, schedule, m, v, recv_ahead=0):
    """Run every rank's action list through its PipelineP2P (ranks one after another: with
    the recorder nothing blocks, and each rank's own issue order is what is checked)."""
    p = len(schedule)
    last = p * v - 1
    for rank, actions in enumerate(schedule):
        comm = PipelineP2P.for_schedule(schedule, rank, list(range(p)), None, m, v, SHAPE,
                                        recv_ahead=recv_ahead)
        recorder.current = comm
        for action in actions:
            stage = action.chunk * p + rank
            mb = action.microbatch
            if action.kind == "F":
                if stage > 0:
                    comm.recv(Message("act", mb, stage - 1, stage))
                recorder.log.setdefault(rank, []).append(("compute", None, action))
                if stage < last:
                    comm.send(Message("act", mb, stage, stage + 1), torch.zeros(SHAPE))
            else:
                if stage < last:
                    comm.recv(Message("grad", mb, stage + 1, stage))
                recorder.log.setdefault(rank, []).append(("compute", None, action))
                if stage > 0:
                    comm.send(Message("grad", mb, stage, stage - 1), torch.zeros(SHAPE))
            recorder.outstanding.setdefault(rank, []).append(len(comm._pending_recvs))
        comm.finish()


def _configs():
    for p, v, m in itertools.product(range(2, 5), range(1, 4), range(1, 9)):
        for g in ([None] if v == 1 else range(p, m + 1)):
            if v > 1 and m % g and m % g < p:
                continue
            yield p, m, v, g


@pytest.mark.parametrize("only_forward", [False, True])
@pytest.mark.parametrize("recv_ahead", [0, 3, 1000])
def test_both_ends_of_every_link_issue_the_same_sequence(monkeypatch, only_forward, recv_ahead):
    """With receives posted ahead (gloo) the sends and receives of a link may interleave
    differently on its two ends, but each direction keeps one order."""
    checked = 0
    for p, m, v, g in _configs():
        recorder = _recording(monkeypatch)
        schedule = build_schedule(p, m, v, g)
        if only_forward:
            schedule = [forward_only(actions) for actions in schedule]
        _drive(recorder, schedule, m, v, recv_ahead)
        for a, b in itertools.combinations(range(p), 2):
            a_side = [(op, msg) for op, peer, msg in recorder.log.get(a, []) if peer == b]
            b_side = [(op, msg) for op, peer, msg in recorder.log.get(b, []) if peer == a]
            flipped = [("recv" if op == "send" else "send", msg) for op, msg in b_side]
            if recv_ahead == 0:   # one sequence per link (an order-matched transport, NCCL)
                assert a_side == flipped, (p, m, v, g, a, b)
            for op in ("send", "recv"):   # each direction in order (gloo matches per pair)
                assert [x for x in a_side if x[0] == op] == [x for x in flipped if x[0] == op]
        checked += 1
    assert checked > 90


def test_receives_are_posted_before_the_compute_they_can_overlap(monkeypatch):
    """A receive is issued as soon as the operation before it in the order is (Megatron's
    send_forward_recv_backward, generalised): never is an action computed between a receive's
    predecessor and the receive's posting, so the peer's message can land during that compute
    (a receive posted only when its consumer asks for it fails this check)."""
    checked = 0
    for p, m, v, g in _configs():
        recorder = _recording(monkeypatch)
        _drive(recorder, build_schedule(p, m, v, g), m, v)
        for rank, log in recorder.log.items():
            ops = [i for i, (op, _, _) in enumerate(log) if op != "compute"]
            for before, after in zip(ops, ops[1:]):
                computed = [log[i][2] for i in range(before + 1, after)]
                assert log[after][0] == "send" or not computed, (p, m, v, g, rank, log[after])
        checked += 1
    assert checked > 90


def test_receives_ahead_stay_within_the_depth_and_run_past_sends(monkeypatch):
    """recv_ahead = N: after each action at most max(N, what the strict order has posted then)
    receives are outstanding; N larger than a rank's receives posts them all by the end of its
    first action that touches the p2p; and N > 0 posts more than the strict order somewhere."""
    checked = 0
    for p, m, v, g in _configs():
        schedule = build_schedule(p, m, v, g)
        strict = _recording(monkeypatch)
        _drive(strict, schedule, m, v)
        for depth in (1, 2, 1000):
            ahead = _recording(monkeypatch)
            _drive(ahead, schedule, m, v, depth)
            for rank in range(p):
                pairs = list(zip(ahead.outstanding[rank], strict.outstanding[rank]))
                assert all(a <= max(depth, s) for a, s in pairs), (p, m, v, g, depth, rank)
                receives = [op for op, _, _ in ahead.log[rank] if op == "recv"]
                if depth == 1000 and receives:
                    computes = [i for i, (op, _, _) in enumerate(ahead.log[rank])
                                if op == "compute"]
                    last_recv = max(i for i, (op, _, _) in enumerate(ahead.log[rank])
                                    if op == "recv")
                    assert last_recv < computes[1], (p, m, v, g, rank)
            if m * v > p:
                assert any(a > s for rank in range(p)
                           for a, s in zip(ahead.outstanding[rank], strict.outstanding[rank]))
            checked += 1
    assert checked > 270


@pytest.mark.parametrize("requested, backend, expected", [
    (None, "gloo", p2p_module.GLOO_RECV_AHEAD), (None, "nccl", 0), (0, "nccl", 0),
    (7, "gloo", 7), (0, "gloo", 0)])
def test_recv_ahead_default_per_backend(requested, backend, expected):
    assert p2p_module.recv_ahead_for(requested, backend) == expected


@pytest.mark.parametrize("requested, backend, words", [
    (2, "nccl", ["p2p_recv_ahead=2", "gloo", "'nccl'"]), (-1, "gloo", ["p2p_recv_ahead=-1"]),
    (True, "gloo", ["p2p_recv_ahead=True"])])
def test_recv_ahead_refuses_bad_settings(requested, backend, words):
    with pytest.raises(ValueError) as info:
        p2p_module.recv_ahead_for(requested, backend)
    for word in words:
        assert word in str(info.value)


def test_trainer_refuses_receiving_ahead_off_gloo_before_any_group(monkeypatch):
    from tpfuse.models import TransformerConfig
    from tpfuse.runtime import initialize

    monkeypatch.setattr(initialize.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(initialize.dist, "get_backend", lambda group=None: "nccl")
    shape = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=16)
    with pytest.raises(ValueError, match="p2p_recv_ahead=2 needs the gloo backend"):
        initialize.check_layout(TransformerConfig(**shape, pipeline_model_parallel_size=2,
                                                  p2p_recv_ahead=2))
    initialize.check_layout(TransformerConfig(**shape, pipeline_model_parallel_size=2))
    initialize.check_layout(TransformerConfig(**shape, p2p_recv_ahead=2))   # pp 1: no p2p


def test_message_order_at_pp2_interleaved_mixes_directions():
    # p2 v2 m4 g4: rank 1 sends activation 3 (stage 1 -> 2) before gradient 0 (stage 3 -> 2);
    # rank 0 needs gradient 0 first, so it must post both receives in rank 1's order
    order = p2p_module.message_order(build_schedule(2, 4, 2, 4), 0, 4, 2)
    act3, grad0 = Message("act", 3, 1, 2), Message("grad", 0, 3, 2)
    assert order.index(act3) < order.index(grad0)
    assert len(order) == len(set(order)) == 4 * 6   # 3 activations + 3 gradients per mb


def test_deadlocking_schedule_is_refused_before_any_message():
    from tpfuse.pipeline.schedules import Action

    bad = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
           [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        PipelineP2P.for_schedule(bad, 0, [0, 1], None, 2, 1, SHAPE)


# ------------------------------------------------------------------ the cached plan

def _reference_order(result, rank):
    """The order as the executor derived it before plans were cached: from the full simulation
    (reorder analysis included), every message of this rank keyed by (time, sender, position)."""
    keyed = [(result.message_times[msg], src, pos, msg)
             for (src, dst), sent in result.send_order.items() if rank in (src, dst)
             for pos, msg in enumerate(sent)]
    return [msg for *_, msg in sorted(keyed, key=lambda k: k[:3])]


def _schedule_configs():
    """Every (p, m, v, g) the schedule tests cover (tests/pipeline/test_schedules.py::_valid_configs)."""
    for p, v, m in itertools.product(range(1, 5), range(1, 4), range(1, 11)):
        for g in ([None] if v == 1 else range(p, m + 1)):
            if v > 1 and m % g and m % g < p:
                continue
            yield p, m, v, g


def test_cached_plan_matches_the_uncached_order_for_every_schedule_config():
    from tpfuse.pipeline.plan import clear_plan_cache, rank_plan
    from tpfuse.pipeline.simulate import simulate
    from tpfuse.pipeline.zero_bubble import build_zb_h1_schedule

    clear_plan_cache()
    checked = 0
    for p, m, v, g in _schedule_configs():
        cases = [("1f1b" if v == 1 else "interleaved", build_schedule(p, m, v, g))]
        if v == 1:
            cases.append(("zb-h1", build_zb_h1_schedule(p, m)))
        for kind, schedule in cases:
            for only_forward in (False, True):
                expected = [forward_only(a) for a in schedule] if only_forward else schedule
                result = simulate(expected, m, v)
                for rank in range(p):
                    plan = rank_plan(kind, p, m, v, g, only_forward, rank)
                    assert list(plan.actions) == expected[rank], (kind, p, m, v, g, rank)
                    assert list(plan.messages) == _reference_order(result, rank), (
                        kind, p, m, v, g, only_forward, rank)
                    # steps name exactly the messages each action receives and sends
                    for action, recv, send in plan.steps:
                        for index in (recv, send):
                            if index is not None:
                                message = plan.messages[index]
                                assert message.microbatch == action.microbatch
                checked += 1
    assert checked > 500


def test_plan_is_computed_once_per_configuration():
    from tpfuse.pipeline.plan import _plans, clear_plan_cache, rank_plan

    clear_plan_cache()
    first = rank_plan("interleaved", 4, 8, 2, None, False, 1)
    assert rank_plan("interleaved", 4, 8, 2, 4, False, 1) is first   # g None == g pp
    rank_plan("interleaved", 4, 8, 2, None, False, 3)                # another rank: same build
    assert _plans.cache_info().misses == 1
    assert rank_plan("interleaved", 4, 8, 2, None, True, 1) is not first   # forward-only
    assert _plans.cache_info().misses == 2


@pytest.mark.parametrize("args, words", [
    (("2f2b", 2, 4), ["pipeline schedule", "2f2b"]),
    (("1f1b", 2, 4, 2), ["vpp_size=2", "one model chunk"]),
    (("interleaved", 4, 5, 2), ["num_microbatches=5", "microbatch_group_size"]),
    (("1f1b", 2, 0), ["num_microbatches"]),
])
def test_rank_plan_rejects_bad_settings(args, words):
    from tpfuse.pipeline.plan import rank_plan

    with pytest.raises(ValueError) as info:
        rank_plan(*args)
    for word in words:
        assert word in str(info.value)
