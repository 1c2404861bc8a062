"""Megatron's private mapping Functions (``tensor_parallel.mappings._CopyToModelParallelRegion``
...) called the way Megatron's own unit tests call them — ``backward(ctx, grad)`` with a ``ctx``
holding ``group``, ``symbolic(None, input_, group)`` — at tp = 2 on gloo, against the values the
collectives must give (exact: sums of small integers in fp32)."""
import torch
import torch.distributed as dist


def _check_all():
    from tpfuse.megatron_compat import parallel_state
    from tpfuse.megatron_compat.tensor_parallel import mappings

    parallel_state.initialize_model_parallel(2, 1)
    try:
        rank, group = dist.get_rank(), parallel_state.get_tensor_model_parallel_group()

        class Ctx:
            pass
        ctx = Ctx()
        ctx.group = group
        x = torch.ones(1) * rank
        out, none = mappings._CopyToModelParallelRegion.backward(ctx, x)
        assert none is None and torch.equal(out, torch.ones(1))           # 0 + 1
        assert torch.equal(mappings._CopyToModelParallelRegion.symbolic(None, x, group), x)
        assert torch.equal(mappings._ReduceFromModelParallelRegion.symbolic(None, x, group),
                           torch.ones(1))
        assert torch.equal(mappings._ReduceFromModelParallelRegion.backward(ctx, x)[0], x)
        full = torch.arange(8.0).view(2, 4)
        part = mappings._ScatterToModelParallelRegion.symbolic(None, full, group)
        assert torch.equal(part, full[:, 2 * rank:2 * rank + 2])
        assert torch.equal(mappings._ScatterToModelParallelRegion.backward(ctx, part)[0], full)
        assert torch.equal(mappings._GatherFromModelParallelRegion.symbolic(None, part, group),
                           full)
        rows = torch.arange(8.0).view(4, 2)
        mine = mappings._ScatterToSequenceParallelRegion.symbolic(None, rows, group)
        assert torch.equal(mine, rows[2 * rank:2 * rank + 2])
        assert torch.equal(mappings._ScatterToSequenceParallelRegion.backward(ctx, mine)[0],
                           rows)
        gathered = mappings._GatherFromSequenceParallelRegion.symbolic(None, mine, True, group)
        assert torch.equal(gathered, rows)
        ctx.tensor_parallel_output_grad, ctx.output_split_sizes = True, None
        grad = mappings._GatherFromSequenceParallelRegion.backward(ctx, rows)[0]
        assert torch.equal(grad, 2 * rows[2 * rank:2 * rank + 2])          # summed over 2
        scattered = mappings._ReduceScatterToSequenceParallelRegion.symbolic(None, rows, group)
        assert torch.equal(scattered, 2 * rows[2 * rank:2 * rank + 2])
        ctx.input_split_sizes = None
        back = mappings._ReduceScatterToSequenceParallelRegion.backward(ctx, mine)
        assert torch.equal(back[0], rows) and len(back) == 4
        last = mappings._AllGatherFromTensorParallelRegion.symbolic(None, part, group)
        assert torch.equal(last, full)
        reduced = mappings._ReduceScatterToTensorParallelRegion.symbolic(None, full, group)
        assert torch.equal(reduced, 2 * part)
        swapped = mappings._AllToAll.apply(group, rows, None, None)
        expected = torch.cat([torch.arange(8.0).view(4, 2)[2 * rank:2 * rank + 2]] * 2)
        assert torch.equal(swapped, expected)
        return True
    finally:
        parallel_state.destroy_model_parallel()


def test_private_mapping_functions_under_megatron_names(run_distributed):
    assert run_distributed(2, _check_all) == [True, True]
