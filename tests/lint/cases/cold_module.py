"""No hot path here: every forbidden call is fine outside hooks."""

import torch
import torch.distributed as dist


def evaluate(model, batch):
    out = model(batch)
    loss = out.sum()
    if loss > 0:
        print(f"loss={loss.item():.3f}", out.cpu().tolist())
    mask = out > 0
    dist.all_reduce(loss)
    try:
        return float(loss), out[mask].unique(), torch.equal(out, out)
    except RuntimeError:
        return None


class Trainer:
    def step(self, batch):
        torch.cuda.synchronize()
        return batch.nonzero()

    def declare_metrics(self, metrics):
        metrics.declare("loss")
