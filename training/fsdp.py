"""Fully sharded data parallelism through PyTorch's ``fully_shard`` (FSDP2): ZeRO-2 and ZeRO-3.

``--use-torch-fsdp2`` shards every model chunk over the data-parallel mesh (dp × cp ranks,
``state.dp_cp_group``), one FSDP unit per transformer layer plus the chunk itself (embedding,
final norm, output layer: the tied word embedding and the output layer share one Parameter, so
they sit in one unit). The local tensors FSDP shards are tpfuse's tensor-parallel shards: a
parameter of TP shard shape (n0, n1, ...) is cut along dim 0 into dp_cp row blocks of
c = ⌈n0/dp_cp⌉ rows (the last ones shorter or empty; FSDP pads each to c rows), so TP, SP, PP
(every virtual chunk its own root) and CP compose unchanged. Expert parameters
(``allreduce = False``) form their own unit over the expert-data-parallel mesh
(``state.group("edp")``) when edp > 1; their gradients must be divided by dp_cp, not edp (the
loss averages the tokens of all dp·cp replicas, Megatron's scaling): FSDP's 1/edp is rescaled by
edp/dp_cp after backward. With edp = 1 they stay unsharded (``ignored_params``), scaled by
1/dp_cp after backward.

Strategies (Megatron's ``--data-parallel-sharding-strategy`` values)::

    optim_grads         ZeRO-2: reshard_after_forward=False  (parameters gathered for forward stay
                                 until the step's last backward; gradients reduce-scattered)
    optim_grads_params  ZeRO-3: reshard_after_forward=True   (re-sharded after forward, gathered
                                 again for backward)

Gradient accumulation without communication: a step's m micro-batches accumulate each unit's
unsharded gradient (fp32: ``reduce_dtype``) with the reduce-scatter off
(``set_requires_gradient_sync(False)``); a gradient hook on each chunk's output counts the
chunk's backwards and turns it on for the m-th, so each unit reduce-scatters once per step, in
its last backward: g_shard = RS_{dp·cp}(Σ_micro g) / dp_cp, the sum the bucketed buffers
all-reduce. ZeRO-2 also keeps its gathered parameters across the
micro-batches (``set_reshard_after_backward(False)`` until that last backward): one all-gather
per unit per step. ZeRO-3 re-shards after every forward and backward (gathered twice per
micro-batch, less its seams below). The price: from a unit's first backward to its last, the
unit holds its unsharded fp32 gradient (ZeRO-2 its unsharded parameters too), so within a step
the gradients peak at the TP shard's size, as plain data parallelism's buffer; between steps a
rank holds 1/dp_cp.

ZeRO-3 without a pipeline (pp = 1: F0 B0 F1 B1 ...) keeps gathered across the seams between
passes what it would re-shard and gather again at once (``keeps_seams``): after a forward the
last layer and the root (embedding, output layer: torchtitan's last-block rule, FSDP2's own
root default), whose backward comes next; after a backward that is not the step's last the
first layer and the root, which the next forward opens with. The seam holds them gathered
either way, so the peak is ZeRO-3's; per step the root is gathered once, the last layer m
times, the first m + 1, every other layer 2m (``gathers_per_step``). With a pipeline other
micro-batches' passes fall between (1F1B's warm-up, interleaved chunks): every unit re-shards.

On the host (gloo) the reduce-scatter runs as the state's ``comm_options.reduce_scatter`` says
(``parallel.reduce_scatter``; by default a ring all-reduce with this rank's block copied out,
``_DeferredReduceScatter``), started asynchronously and completed in ``finish_grad_sync``, so it
overlaps the backward of the layers before it, as the bucketed buffers' ``overlap_grad_reduce``
does; on CUDA (NCCL) FSDP2 runs its own reduce-scatter. Mixed precision
(``MixedPrecisionPolicy``): bf16/fp16 compute, fp32 reduce, fp32 sharded parameters, which are
the optimizer's main parameters (``training/fsdp_optimizer.py``).

Hybrid sharding (HSDP, ``--num-distributed-optimizer-instances`` N > 1: Megatron's flag of the
distributed optimizer's instances, read for FSDP2 too, as torchtitan's dp_replicate × dp_shard):
each unit's mesh is 2-D, (replicate N, shard n/N) over the dp·cp ranks (experts: over edp), rows
the ``intra-*`` groups of ``ParallelState``, columns the ``inter-*`` ones. FSDP reduce-scatters
inside the row and all-reduces the shard down the column (``fully_shard(mesh=...)``'s HSDP); a
rank holds 1/(n/N) of every parameter, the same shard as its N − 1 replicas. On the host the
reduce-scatter then completes at once (the all-reduce reads it) and both run as sums
(``set_force_sum_reduction_for_comms``: gloo has no ``AVG``), FSDP dividing by n after.

Zero-bubble (``--pipeline-schedule zb-h1``): a W action computes weight gradients after the I
pass (the autograd backward) that deferred them, so no backward may reduce-scatter: every I pass
accumulates, and ``finish_grad_sync`` reduce-scatters each chunk's accumulated gradients after
the schedule, W's included (``_reduce_accumulated_grads``, the calls of
``torch.distributed.pipelining``'s REDUCE_GRAD action). An I pass opens its queue on the
parameters the chunk holds at that moment: ZeRO-2's are the gathered ones the layers compute
with; ZeRO-3 has re-sharded after forward, so it is opened on the sharded parameters, and the
chunk-output hook puts it on the gathered weights too (``_share_weight_grad_queues``): in
both, the weight GEMMs move to W.

Activation recompute composes: a recomputed region runs its units' forwards again inside
backward, where FSDP neither re-shards after forward nor records the forward again (its
``is_bw()`` check), and the first, graph-less forward registered no backward hook; the counting
hook sits on the chunk's output, which recompute never re-runs.

This object stands where ``DataParallelBuffers`` stands in the training step (``zero_grad_buffer``,
``begin_step``, ``finish_grad_sync``, ``start_param_sync`` / ``finish_param_sync``); FSDP's own
hooks do the communication, so most of these are bookkeeping. Timers: FSDP's all-gathers and
reduce-scatters run inside the schedule, under ``forward-backward``; ``all-grads-sync`` holds the
zero-bubble reduction and the expert rescale. The start-up memory record is
``FullyShardedOptimizer.memory_bytes`` (the padded shards, ``fsdp_rank_bytes`` for planners).
Checkpoints: ``checkpoint/sharded_state.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpfuse.parallel.reduce_scatter import reduce_scatter_tensor

from .data_parallel import is_expert, trainable_parameters

STRATEGY_RESHARDS = {"optim_grads": False, "optim_grads_params": True}


@dataclass(frozen=True)
class FsdpConfig:
    """What ``FullyShardedModel`` needs of the settings; ``use_distributed_optimizer`` is False
    (the optimizer's pieces are FSDP's shards, see fsdp_optimizer.py)."""
    strategy: str
    compute_dtype: torch.dtype          # the model's params_dtype: what forward/backward run in
    use_distributed_optimizer: bool = False
    deferred_weight_grads: bool = False  # zero-bubble (zb-h1): W runs weight GEMMs after I

    @property
    def reshard_after_forward(self) -> bool:
        return STRATEGY_RESHARDS[self.strategy]


def keeps_seams(strategy: str, pp: int) -> bool:
    """ZeRO-3 without a pipeline keeps its seam units gathered (module docstring)."""
    return STRATEGY_RESHARDS[strategy] and pp == 1


def gathers_per_step(strategy: str, num_microbatches: int, *, kept_after_forward: bool,
                     kept_after_backward: bool) -> int:
    """All-gathers of one unit per step of m micro-batches: ZeRO-2 once; ZeRO-3 in every
    forward and backward (2m), less those a seam keeps: kept after forward, m (each backward
    reuses its forward's); kept after a backward that is not the step's last, m + 1 (each
    forward after the first reuses it); both, once."""
    m = num_microbatches
    if not STRATEGY_RESHARDS[strategy] or (kept_after_forward and kept_after_backward):
        return 1
    if kept_after_forward:
        return m
    return m + 1 if kept_after_backward else 2 * m


# -------------------------------------------------------------------- pure shard arithmetic
def shard_rows(rows: int, dp: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of dim 0 that FSDP rank ``rank`` of ``dp`` holds (torch.chunk's cut:
    blocks of ⌈rows/dp⌉, the trailing ranks shorter or empty)."""
    block = math.ceil(rows / dp) if rows else 0
    return min(rows, rank * block), min(rows, (rank + 1) * block)


def padded_shard_numel(shape, dp: int) -> int:
    """Elements one rank allocates for a parameter of ``shape`` sharded over ``dp``: ⌈n0/dp⌉ rows
    (the padding included), the same on every rank."""
    if not shape:
        return math.ceil(1 / dp)
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / dp) * rest


def fsdp_rank_bytes(shapes, dp: int, *, param_bytes: int = 4, grad_bytes: int = 4,
                    moment_bytes: int = 8) -> dict:
    """Per-rank bytes of parameters, gradients and Adam moments of FSDP-sharded parameters of
    ``shapes`` (TP-shard shapes) over ``dp``: each is the padded shard (``padded_shard_numel``)
    times its element size (fp32 master parameters, fp32 gradients, two fp32 moments). A pure
    function, for planners; ``FullyShardedModel.memory_bytes`` measures the same."""
    elements = sum(padded_shard_numel(tuple(shape), dp) for shape in shapes)
    return {"parameters": elements * param_bytes, "main_parameters": 0,
            "gradients": elements * grad_bytes, "optimizer_state": elements * moment_bytes}


# -------------------------------------------------------------------- refusals
def check_fsdp_layout(config) -> None:
    """What FSDP cannot run, refused before any process group exists: a PyTorch without
    ``fully_shard`` (Megatron's ``torch >= 2.4`` requirement). Every schedule (zb-h1 included)
    and recompute granularity composes (module docstring)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as error:
        raise ValueError("--use-torch-fsdp2 needs PyTorch's torch.distributed.fsdp.fully_shard "
                         f"(torch >= 2.4), this torch {torch.__version__} has none") from error


# -------------------------------------------------------------------- the wrapper
def _parameter_attributes(chunk) -> dict:
    """name → tpfuse's attributes of the Parameter (``tensor_model_parallel``, ``allreduce``,
    ``shared_embedding``, ...): fully_shard makes new Parameters, these go on them again."""
    return {name: dict(vars(param)) for name, param in chunk.named_parameters()}


def _expert_units(layer) -> list:
    """The outermost submodules of ``layer`` holding only expert parameters."""
    units = []

    def visit(module):
        params = list(module.parameters())
        if params and all(is_expert(p) for p in params):
            units.append(module)
            return
        for child in module.children():
            visit(child)
    for child in layer.children():
        visit(child)
    return units


class FullyShardedModel:
    """The FSDP2 units of one rank's model chunks (see the module docstring)."""

    def __init__(self, model_chunks, config: FsdpConfig, state):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.chunks, self.config, self.state = list(model_chunks), config, state
        self.dp_cp = state.size("dp-cp")
        device_type = _device_type()
        self.hybrid = state.num_distributed_optimizer_instances > 1
        dense_mesh = _data_parallel_mesh(DeviceMesh, state, "dp-cp", device_type)
        edp = state.size("edp")
        expert_mesh = (_data_parallel_mesh(DeviceMesh, state, "edp", device_type) if edp > 1
                       else None)
        compute = config.compute_dtype
        policy = MixedPrecisionPolicy(
            param_dtype=None if compute == torch.float32 else compute,
            reduce_dtype=torch.float32, output_dtype=None)
        self.unsharded_experts = []
        self.seams = keeps_seams(config.strategy, state.size("pp"))
        units = []
        for chunk in self.chunks:
            attributes = _parameter_attributes(chunk)
            chunk.float()                               # fp32 sharded master parameters
            layers = _layers_of(chunk)
            for layer in layers:
                kept_after_forward = self.seams and layer is layers[-1]
                reshard = config.reshard_after_forward and not kept_after_forward
                experts = _expert_units(layer)
                if expert_mesh is not None:
                    for unit in experts:
                        units.append(fully_shard(unit, mesh=expert_mesh, mp_policy=policy,
                                     reshard_after_forward=reshard))
                    ignored = None
                else:
                    ignored = {p for unit in experts for p in unit.parameters()}
                    self.unsharded_experts += list(ignored)
                units.append(fully_shard(layer, mesh=dense_mesh, mp_policy=policy,
                                         ignored_params=ignored, reshard_after_forward=reshard))
            units.append(fully_shard(chunk, mesh=dense_mesh, mp_policy=policy,
                                     ignored_params=set(self.unsharded_experts) or None,
                                     reshard_after_forward=config.reshard_after_forward
                                     and not self.seams))
            for name, values in attributes.items():
                param = chunk.get_parameter(name)
                for key, value in values.items():
                    setattr(param, key, value)
        self.reduce_scatter = None                     # gloo's deferred reductions
        if device_type == "cpu":
            reduce_scatter = self.reduce_scatter = _DeferredReduceScatter(state, self.hybrid)
            for unit in units:
                unit.set_custom_reduce_scatter(reduce_scatter)
                if self.hybrid:
                    unit.set_force_sum_reduction_for_comms(True)
            for chunk in self.chunks:
                _prefetch_asynchronously(chunk)
        self.params = trainable_parameters(self.chunks)
        self.num_microbatches, self.backwards = 1, [0] * len(self.chunks)
        self.synced = [False] * len(self.chunks)
        for index, chunk in enumerate(self.chunks):
            chunk.register_forward_hook(self._backward_counter(index))
        for param in self.params:
            if self.is_sharded(param):
                self._mark_shard(param)
        # FSDP divides an expert unit's gradient by edp (its mesh); the loss wants 1/dp_cp
        # (gloo has no PREMUL_SUM for set_gradient_divide_factor, so the rest is applied after)
        self.sharded_experts = [p for p in self.params if is_expert(p) and self.is_sharded(p)]
        self.expert_rescale = edp / self.dp_cp

    def _mark_shard(self, param) -> None:
        """What the checkpoint package gathers and cuts a shard by (``checkpoint/
        sharded_state.py``): the process group, this rank's place in it and its size (read from
        the ParallelState: a DeviceMesh rebuilt over a reused worker's groups can name a group
        that is gone)."""
        name = "intra-edp" if is_expert(param) else "intra-dp-cp"     # the mesh's shard dim
        param.fsdp_group = self.state.group(name)
        param.fsdp_rank, param.fsdp_size = self.state.rank_in(name) or 0, self.state.size(name)

    # ------------------------------------------------------------------ the step
    def zero_grad_buffer(self) -> None:
        for param in self.params:
            param.grad = None

    def begin_step(self, num_microbatches: int) -> None:
        """Gradient accumulation without communication: every unit accumulates its unsharded
        gradient (``set_requires_gradient_sync(False)``) until the chunk's last backward turns
        the reduce-scatter on; ZeRO-2 keeps its gathered parameters across the micro-batches
        (``set_reshard_after_backward(False)`` until that last backward)."""
        self.num_microbatches = num_microbatches
        self.backwards = [0] * len(self.chunks)
        self.synced = [False] * len(self.chunks)
        keep_gathered = not self.config.reshard_after_forward
        for chunk in self.chunks:
            chunk.set_requires_gradient_sync(False)
            chunk.set_reshard_after_backward(not keep_gathered)
            if self.seams:             # kept for the next forward (its experts' units too)
                _layers_of(chunk)[0].set_reshard_after_backward(False)
                chunk.set_reshard_after_backward(False, recurse=False)

    def _backward_counter(self, index: int):
        """A forward hook on chunk ``index`` whose gradient hook on the chunk's output counts the
        chunk's backwards of the step; the m-th (every schedule runs a chunk's backwards in
        micro-batch order) reduce-scatters. With deferred weight gradients (zb-h1) the W actions
        still add to the unsharded gradients after the last I pass: ``finish_grad_sync``
        reduces instead."""
        def on_forward(module, args, output):
            if not torch.is_grad_enabled():
                return
            tensors = [t for t in _tensors_of(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads: self._backward_starts(index), mode="any")
        return on_forward

    def _backward_starts(self, index: int) -> None:
        if self.config.deferred_weight_grads:
            _share_weight_grad_queues(self.chunks[index])
            return
        self.backwards[index] += 1
        if self.backwards[index] == self.num_microbatches:
            chunk = self.chunks[index]
            chunk.set_requires_gradient_sync(True)
            chunk.set_reshard_after_backward(True)
            self.synced[index] = True

    def finish_grad_sync(self) -> None:
        """Reduce-scatter what no backward did (deferred weight gradients, a chunk without its
        m backwards), complete gloo's reductions, then expert gradients to 1/dp_cp: the
        unsharded ones (edp = 1) from the plain sum, the sharded ones from FSDP's 1/edp
        (``expert_rescale`` = edp / dp_cp)."""
        for chunk, synced in zip(self.chunks, self.synced):
            if not synced:
                _reduce_accumulated_grads(chunk)
            if self.config.deferred_weight_grads:
                _share_weight_grad_queues(chunk, clear=True)
        if self.reduce_scatter is not None:
            self.reduce_scatter.complete()
        if self.dp_cp == 1:
            return
        for params, factor in ((self.unsharded_experts, 1.0 / self.dp_cp),
                               (self.sharded_experts, self.expert_rescale)):
            for param in params:
                if param.grad is not None and factor != 1.0:
                    grad = param.grad
                    getattr(grad, "_local_tensor", grad).mul_(factor)

    def start_param_sync(self) -> None:
        """FSDP gathers each unit's parameters in its own forward."""

    def finish_param_sync(self, buckets=None) -> None:
        """Nothing in flight between steps."""

    def remove_hooks(self) -> None:
        """FSDP's hooks stay with the modules."""

    # ------------------------------------------------------------------ queries
    def is_sharded(self, param) -> bool:
        return hasattr(param, "_local_tensor")

    def mesh_rank_and_size(self, param) -> tuple[int, int]:
        """(rank, size) of the mesh ``param`` is sharded over ((0, 1) when unsharded)."""
        if not self.is_sharded(param):
            return 0, 1
        return param.fsdp_rank, param.fsdp_size


class _DeferredReduceScatter:
    """FSDP's reduce-scatter on the host: ``parallel.reduce_scatter.reduce_scatter_tensor`` as
    the state's ``comm_options.reduce_scatter`` says (read at each call; by default on gloo the
    ring all-reduce of the whole input with this rank's block copied out: the same sums, about
    twice as fast as gloo's reduce-scatter, the bucketed buffers' reason too). ``AVG`` under the
    all-reduce is the sum divided by the group size; any other op runs the plain reduce-scatter.

    Each reduction starts asynchronously and ``complete()`` (in ``finish_grad_sync``, before
    anything reads a gradient) waits for it (the all-reduce's handle then copies the block out).
    That is sound because FSDP only views ``output_tensor`` as the unit's sharded gradient,
    reading nothing in it: the reduce dtype is the parameters' (fp32 both, so no cast), ``AVG`` /
    ``SUM`` need no pre- or post-division (fp32), and each unit reduces once per step onto a
    gradient that ``zero_grad_buffer`` set to None (nothing to accumulate into)."""

    def __init__(self, state, complete_at_once: bool = False):
        self.state = state
        self.complete_at_once = complete_at_once   # HSDP: FSDP all-reduces the output next
        self.pending = []          # the handles of the started reductions

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.pending.append(reduce_scatter_tensor(
            output_tensor, input_tensor, group, options=self.state.comm_options, op=op,
            async_op=True, preserve_input=False))
        if self.complete_at_once:
            self.complete()
        return None

    def complete(self) -> None:
        """Wait for every started reduction (the all-reduce's handle copies, ``AVG``: divides,
        this rank's block out)."""
        for work in self.pending:
            work.wait()
        self.pending = []


def _data_parallel_mesh(device_mesh, state, base: str, device_type: str):
    """The DeviceMesh FSDP shards over: the ``base`` group (``"dp-cp"`` or ``"edp"``) itself,
    or with N > 1 distributed-optimizer instances the 2-D (replicate N, shard) mesh whose row i
    is instance i (``intra-<base>``) and whose column j holds the j-th rank of every instance
    (``inter-<base>``)."""
    instances = state.num_distributed_optimizer_instances
    if instances == 1:
        return device_mesh.from_group(state.group(base), device_type)
    ranks = torch.tensor(state.ranks(base), dtype=torch.int64).view(instances, -1)
    return device_mesh.from_group([state.group(f"inter-{base}"), state.group(f"intra-{base}")],
                                  device_type, mesh=ranks,
                                  mesh_dim_names=("dp_replicate", "dp_shard"))


def _prefetch_asynchronously(chunk) -> None:
    """On CPU (gloo) FSDP's all-gathers block unless issued asynchronously: the next layer's
    gather is issued before a layer's forward (``set_modules_to_forward_prefetch``; backward
    prefetches the previous one by default) and left to gloo's threads while the layer computes
    (FSDP's ``_set_unshard_async_op``). On CUDA FSDP's own streams overlap them already."""
    layers = _layers_of(chunk)
    for layer, following in zip(layers, layers[1:]):
        layer.set_modules_to_forward_prefetch([following])
    chunk._set_unshard_async_op(True)


def _reduce_accumulated_grads(chunk) -> None:
    """Reduce-scatter every unit's accumulated unsharded gradient of the root ``chunk`` now,
    outside autograd, and re-shard: each parameter group's post-backward with sync on, then the
    root's end-of-backward callback (the calls ``torch.distributed.pipelining`` makes for its
    REDUCE_GRAD action; FSDP2 has no public entry for a reduction after backward)."""
    from torch.distributed.fsdp import fully_shard

    chunk.set_requires_gradient_sync(True)
    chunk.set_reshard_after_backward(True)
    root = fully_shard.state(chunk)
    for state in root._state_ctx.all_states:
        for group in state._fsdp_param_groups:
            group.post_backward()
    root._root_post_backward_final_callback()


def _fsdp_params(chunk) -> list:
    """The ``FSDPParam`` records of every unit of the root ``chunk`` (FSDP2 internals)."""
    from torch.distributed.fsdp import fully_shard

    return [record for state in fully_shard.state(chunk)._state_ctx.all_states
            for group in state._fsdp_param_groups for record in group.fsdp_params]


def _share_weight_grad_queues(chunk, clear: bool = False) -> None:
    """At the start of a zero-bubble I pass: the queue the schedule opened on the parameters the
    chunk holds (``param.wgrad_queue``, kernels/wgrad_deferral.py) put on the gathered weights
    the layers compute with too, so their GEMMs are deferred whether the unit was sharded at
    that moment (ZeRO-3) or not (ZeRO-2: the gathered weights themselves carry it). ``clear``:
    take them off again (after the step)."""
    for record in _fsdp_params(chunk):
        gathered = getattr(record, "_unsharded_param", None)
        if gathered is None or gathered is record.sharded_param:
            continue
        if clear:
            if getattr(gathered, "wgrad_queue", None) is not None and \
                    getattr(record.sharded_param, "wgrad_queue", None) is None:
                gathered.wgrad_queue = None
            continue
        queue = getattr(record.sharded_param, "wgrad_queue", None)
        if queue is not None:
            gathered.wgrad_queue = queue


def _tensors_of(output) -> list:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors_of(item)]
    return []


def _layers_of(chunk) -> list:
    model = getattr(chunk, "module", chunk)
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"--use-torch-fsdp2: {type(model).__name__} has no .layers to shard one "
                         "unit per transformer layer")
    return list(layers)


def _device_type() -> str:
    return "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"
