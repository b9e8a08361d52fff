"""SL007: collectives on the hot path, and the `collective-ok` permission."""

import functools

import torch
import torch.distributed as dist
from torch.distributed import all_gather_into_tensor


def sync_hook(module, inputs, output):
    dist.all_reduce(output)  # expect: SL007
    torch.distributed.barrier()  # expect: SL007
    work = dist.all_reduce(output, async_op=True)  # expect: SL007
    all_gather_into_tensor(output, output)  # expect: SL007
    dist.broadcast(output, src=0)  # expect: SL007
    dist.reduce(output, dst=0)  # expect: SL007
    dist.isend(output, dst=1)  # expect: SL007
    handle = dist.irecv(output, src=0)  # expect: SL007
    dist.all_to_all_single(output, output)  # expect: SL007
    dist.reduce_scatter_tensor(output, output)  # expect: SL007
    dist.all_gather_object([None, None], 1)  # expect: SL007
    module.process_group.allreduce([output])  # expect: SL007
    dist.all_reduce(  # expect: SL007
        output,
        op=dist.ReduceOp.MAX,
    )
    # Allowed with a reason, on the line or the line above:
    dist.all_reduce(output)  # syncless: collective-ok the router needs the global count here
    # syncless: collective-ok expert capacity must agree across ranks before dispatch
    dist.all_reduce(output)
    dist.all_reduce(  # syncless: collective-ok reason on the first line of a long call
        output,
    )
    # Same names that are not collectives: fine
    picked = output.gather(1, inputs[0].long())
    spread = torch.scatter(output, 1, inputs[0].long(), 0.0)
    total = functools.reduce(lambda a, b: a + b, inputs)
    return work, handle, picked, spread, total


def flush(buffer):
    # Cold path: the one packed reduction per flush.
    dist.all_reduce(buffer)
