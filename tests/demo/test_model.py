import torch

from syncless.demo.config import preset
from syncless.demo.data import BatchSampler
from syncless.demo.dispatch import LocalDispatcher
from syncless.demo.model import MoETransformer, init_weights


def test_expert_init_is_independent_of_sharding():
    """Rank r's expert slices equal the unsharded model's slices for the same experts."""
    cfg = preset("tiny", n_experts=4)
    full = MoETransformer(cfg)
    init_weights(full, seed=7)

    class HalfDispatcher(LocalDispatcher):
        def local_experts(self, n):
            return n // 2

        def first_local_expert(self, n):
            return n // 2

    shard = MoETransformer(cfg, HalfDispatcher())
    init_weights(shard, seed=7)
    full_params = dict(full.named_parameters())
    for name, p in shard.named_parameters():
        if ".experts." in name:
            torch.testing.assert_close(p, full_params[name][2:], rtol=0, atol=0)
        else:
            torch.testing.assert_close(p, full_params[name], rtol=0, atol=0)


def test_sampler_rank_slices_concatenate_to_the_single_process_batch():
    corpus = torch.arange(10_000, dtype=torch.int64) % 251
    whole = BatchSampler(corpus, seq_len=16, batch=6, rank=0, world_size=1, seed=3)
    parts = [BatchSampler(corpus, 16, 2, rank=r, world_size=3, seed=3) for r in range(3)]
    for step in (0, 1, 17):
        x, y = whole.batch_at(step)
        xs, ys = zip(*(p.batch_at(step) for p in parts), strict=True)
        assert torch.equal(torch.cat(xs), x) and torch.equal(torch.cat(ys), y)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one byte
