"""SL006: data-dependent shapes and Python results."""

import torch


def shape_hook(module, inputs, output):
    idx = output.nonzero()  # expect: SL006
    idx2 = torch.nonzero(output > 0)  # expect: SL006
    vals = output.unique()  # expect: SL006
    runs = torch.unique_consecutive(output)  # expect: SL006
    picked = output.masked_select(output > 0)  # expect: SL006
    mask = output > 0
    pos = output[mask]  # expect: SL006
    neg = output[output < 0]  # expect: SL006
    output[mask] = 0  # expect: SL006
    rows = output[:, mask.any(0)]  # expect: SL006
    both = output[mask & ~torch.isnan(output)]  # expect: SL006
    counts = torch.bincount(output.long().flatten())  # expect: SL006
    hist = output.histc(bins=10)  # expect: SL006
    same = torch.equal(output, inputs[0])  # expect: SL006
    close = output.allclose(inputs[0])  # expect: SL006
    where = torch.where(mask)  # expect: SL006
    reps = torch.repeat_interleave(output, output.long())  # expect: SL006
    reps2 = output.repeat_interleave(mask.long())  # expect: SL006
    reps3 = torch.repeat_interleave(mask.long())  # expect: SL006
    located = torch.argwhere(output)  # expect: SL006
    # fixed shapes: fine
    kept = torch.where(mask, output, 0)
    filled = output.masked_fill(~mask, 0)
    static = torch.nonzero_static(output, size=4)
    fixed = output.repeat_interleave(2)
    sized = torch.repeat_interleave(output, output.long(), output_size=8)
    first = output[0]
    gathered = output[inputs[0].long()]  # an integer index has a fixed shape
    sliced = output[:, 1:3]
    return (idx, idx2, vals, runs, picked, pos, neg, rows, both, counts, hist, same, close,
            where, reps, reps2, reps3, located, kept, filled, static, fixed, sized, first,
            gathered, sliced)


def cold(output):
    return output[output > 0].unique()
