"""The MoE layer across expert-parallel layouts equals the single-process MoE (dropless).

Four gloo ranks hold the tokens of several micro-batches (data parallel) split over the sequence
(sequence parallelism when tp = 2); every layout — ep = 1, 2, 4; etp = 1, 2; both dispatchers;
grouped GEMM and the expert loop; gelu, gelu_tanh and swiglu; with biases, a shared expert, the
load-balancing loss (aux_loss or seq_aux_loss) and the z-loss, the shared expert's sigmoid gate on
in every other layout (ep2, ep4, tp2-ep2-etp1) — must give, on every rank:
the outputs of its tokens, the input gradients, and every parameter gradient (after the reductions
the trainer performs: dense parameters over dp, expert parameters over edp) equal to the float64
dense reference of ``_moe_reference.py`` on the full micro-batches. The logged losses (partials
summed over the sequence partition group) equal the reference's per micro-batch.

Tolerance: the layer runs in fp32; it sums the same terms as the reference in another order
(GEMMs split over etp, expert outputs combined after an all-to-all, gradients summed over ranks),
so results differ by rounding only: ~K·eps(fp32) relative for K ≤ 32-term dot products (see
_tp_testing.py): rtol = atol = 1e-5. A token sent to a wrong expert, a missing reduction or a
double-counted bias or loss is off by far more.
"""
import pytest
import torch
import torch.distributed as dist

from support.moe_reference import draw_masters, reference_moe
from support.tp_testing import ATOL, RTOL
from tpfuse.models.config import TransformerConfig
from tpfuse.moe import MoELayer, RouterLossTracker
from tpfuse.parallel.state import ParallelState
from tpfuse.tp_layers.init import shard, unshard

SEQ, BATCH, HIDDEN, FFN, EXPERTS, TOPK = 8, 2, 16, 8, 4, 2

LAYOUTS = {  # name: (tp, ep, etp) over 4 ranks
    "ep1": (1, 1, 1), "ep2": (1, 2, 1), "ep4": (1, 4, 1), "ep2-etp2": (1, 2, 2),
    "tp2-ep2-etp2": (2, 2, 2), "tp2-ep2-etp1": (2, 2, 1), "tp2-ep1-etp2": (2, 1, 2),
}


def _cfg(variant):
    return {"hidden": HIDDEN, "ffn": FFN, "experts": EXPERTS, "topk": TOPK,
            "activation": ("gelu", "swiglu", "gelu_tanh")[variant % 3], "bias": True, "shared": 8,
            "shared_gate": variant % 2 == 1,
            "score_function": "softmax", "aux_coeff": 0.1,
            "balancing": "seq_aux_loss" if variant % 2 else "aux_loss", "z_coeff": 0.01}


def _config(cfg, tp, ep, etp, dispatcher, grouped):
    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=32, seq_length=SEQ,
        vocab_size=64,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN,
        moe_router_topk=TOPK, activation=cfg["activation"], add_bias_linear=cfg["bias"],
        moe_shared_expert_intermediate_size=cfg["shared"],
        moe_shared_expert_gate=cfg["shared_gate"],
        moe_router_load_balancing_type=cfg["balancing"], moe_aux_loss_coeff=cfg["aux_coeff"],
        moe_z_loss_coeff=cfg["z_coeff"], moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped)


def _expert_block(master, state, ep_size):
    """This ep rank's consecutive block of experts (dim 0)."""
    block = master.shape[0] // ep_size
    return master[state.ep_rank * block:(state.ep_rank + 1) * block]


def _expert_slice(master, state, dim, stride, ep_size):
    return shard(_expert_block(master, state, ep_size), dim, state.etp_size, state.etp_rank,
                 stride)


def _load(layer, m, state, stride, ep_size):
    """Copy the float64 masters' slices of this rank into the layer (fp32)."""
    tp, r = state.tp_size, state.tp_rank
    values = {
        "router.weight": m["router"],
        "experts.weight1": _expert_slice(m["w1"], state, 2, stride, ep_size),
        "experts.weight2": _expert_slice(m["w2"], state, 1, 1, ep_size),
        "experts.bias1": _expert_slice(m["b1"], state, 1, stride, ep_size),
        "experts.bias2": _expert_block(m["b2"], state, ep_size),
        "shared_experts.linear_fc1.weight": shard(m["shared_fc1"], 0, tp, r, stride),
        "shared_experts.linear_fc1.bias": shard(m["shared_fc1_bias"][:, None], 0, tp, r,
                                                stride)[:, 0],
        "shared_experts.linear_fc2.weight": shard(m["shared_fc2"], 1, tp, r),
        "shared_experts.linear_fc2.bias": m["shared_fc2_bias"],
        "shared_experts.gate_weight": m.get("shared_gate"),
    }
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(values[name].detach())


def _gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _full_grad(name, param, state):
    """The single-process gradient of ``param`` from every rank's shard, reduced as the trainer
    does (expert parameters over edp, the others over dp)."""
    grad = param.grad.clone()
    expert = getattr(param, "allreduce", True) is False
    dist.all_reduce(grad, group=state.edp_group if expert else state.dp_group)
    if expert:
        grad = torch.cat(_gather(grad, state.ep_group))               # experts: dim 0 over ep
        group = state.etp_group
    else:
        group = state.tp_group
    if param.tensor_model_parallel:
        grad = unshard(_gather(grad, group), param.partition_dim, param.partition_stride)
    return grad


MASTER_OF = {"router.weight": "router", "experts.weight1": "w1", "experts.weight2": "w2",
             "experts.bias1": "b1", "experts.bias2": "b2",
             "shared_experts.linear_fc1.weight": "shared_fc1",
             "shared_experts.linear_fc1.bias": "shared_fc1_bias",
             "shared_experts.linear_fc2.weight": "shared_fc2",
             "shared_experts.linear_fc2.bias": "shared_fc2_bias",
             "shared_experts.gate_weight": "shared_gate"}


def _check_layout(tp, ep, etp, variant):
    cfg = _cfg(variant)
    stride = 2 if cfg["activation"] == "swiglu" else 1
    state = ParallelState.initialize(tp=tp, ep=ep, etp=etp)
    try:
        dp, dp_rank = state.dp_size, state.dp_rank
        gen = torch.Generator().manual_seed(11 + variant)
        x_all = torch.randn(SEQ, BATCH * dp, HIDDEN, generator=gen, dtype=torch.float64)
        dy_all = torch.randn(SEQ, BATCH * dp, HIDDEN, generator=gen, dtype=torch.float64)
        m = draw_masters(cfg, seed=5 + variant)
        x_ref = x_all.clone().requires_grad_()
        total, losses = 0.0, []
        for d in range(dp):
            cols = slice(d * BATCH, (d + 1) * BATCH)
            y_d, loss_d = reference_moe(x_ref[:, cols], m, cfg)
            total = total + (y_d * dy_all[:, cols]).sum() + loss_d
            losses.append(loss_d)
        total.backward()
        rows = slice(state.tp_rank * SEQ // tp, (state.tp_rank + 1) * SEQ // tp)
        cols = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
        y_ref = torch.cat([reference_moe(x_all[:, c * BATCH:(c + 1) * BATCH].detach(),
                                         {k: v.detach() for k, v in m.items()}, cfg)[0]
                           for c in range(dp)], dim=1)
        for dispatcher, grouped in (("allgather", variant % 2 == 0), ("alltoall", variant % 2)):
            tracker = RouterLossTracker()
            layer = MoELayer(_config(cfg, tp, ep, etp, dispatcher, bool(grouped)), 0, tracker,
                             state)
            _load(layer, m, state, stride, ep)
            x = x_all[rows, cols].float().requires_grad_()
            out, bias = layer(x)
            assert bias is None
            out.backward(dy_all[rows, cols].float())
            what = f"{dispatcher} tp{tp} ep{ep} etp{etp}"
            torch.testing.assert_close(out.double(), y_ref[rows, cols], rtol=RTOL, atol=ATOL,
                                       msg=f"{what}: output")
            torch.testing.assert_close(x.grad.double(), x_ref.grad[rows, cols], rtol=RTOL,
                                       atol=ATOL, msg=f"{what}: input gradient")
            for name, param in layer.named_parameters():
                torch.testing.assert_close(_full_grad(name, param, state).double(),
                                           m[MASTER_OF[name]].grad, rtol=RTOL, atol=ATOL,
                                           msg=f"{what}: gradient of {name}")
            _check_logged_losses(tracker, state, losses[dp_rank], cfg, what)
    finally:
        state.destroy()


def _check_logged_losses(tracker, state, reference_loss, cfg, what):
    logged = torch.zeros(())
    for name, coeff in (("load_balancing_loss", cfg["aux_coeff"]), ("z_loss", cfg["z_coeff"])):
        partial = tracker.values[name][0].clone()
        dist.all_reduce(partial, group=state.group("tp-cp"))
        logged = logged + coeff * partial
    torch.testing.assert_close(logged.double(), reference_loss.detach(), rtol=RTOL, atol=ATOL,
                               msg=f"{what}: logged router losses")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_moe_layer_equals_the_dense_reference(run_distributed, name):
    tp, ep, etp = LAYOUTS[name]
    variant = sorted(LAYOUTS).index(name)
    run_distributed(4, _check_layout, tp, ep, etp, variant)


def _check_round_trips():
    """combine(dispatch(x)) with identity experts is x · Σ_e p(t, e) over the experts that kept t
    — x itself when nothing is dropped — for every layout, both dispatchers, and the padded
    capacity layout (with and without drops). Under etp an expert's output is a partial sum over
    the etp ranks, so the identity expert there is rows / etp. Sums of k ≤ 2 fp32 products (and
    the 1/etp split): 4·eps(fp32)."""
    from tpfuse.moe import apply_capacity, topk_routing
    from tpfuse.moe.dispatcher import AllGatherDispatcher, AlltoAllDispatcher
    from tpfuse.moe.groups import MoEGroups

    gen = torch.Generator().manual_seed(dist.get_rank())
    for tp, ep, etp in LAYOUTS.values():
        state = ParallelState.initialize(tp=tp, ep=ep, etp=etp)
        groups = MoEGroups.from_state(state)
        try:
            for kind, factor in (("allgather", None), ("alltoall", None), ("alltoall", 2.0),
                                 ("alltoall", 0.5)):
                x = torch.randn(SEQ * BATCH // tp, HIDDEN, generator=gen)
                probs, routing_map = topk_routing(torch.randn(len(x), EXPERTS, generator=gen),
                                                  TOPK)
                if factor is not None:
                    probs, routing_map, _ = apply_capacity(probs, routing_map, TOPK, factor)
                if kind == "allgather":
                    dispatcher = AllGatherDispatcher(groups, EXPERTS, TOPK)
                else:
                    dispatcher = AlltoAllDispatcher(groups, EXPERTS, TOPK, factor,
                                                    pad_to_capacity=factor is not None)
                rows, per_expert, plan = dispatcher.dispatch(x, probs, routing_map)
                assert sum(per_expert) == rows.shape[0]
                y = dispatcher.combine(rows / state.etp_size, plan)
                expected = x * probs.sum(dim=1, keepdim=True)
                torch.testing.assert_close(y, expected, rtol=4 * 2.0**-24, atol=1e-6,
                                           msg=f"{kind} capacity {factor} tp{tp} ep{ep} etp{etp}")
        finally:
            state.destroy()


def test_dispatch_then_combine_is_the_identity(run_distributed):
    run_distributed(4, _check_round_trips)
