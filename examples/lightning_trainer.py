"""syncless's monitors in a Lightning Trainer, on a tiny Llama built from a config.

    pip install "syncless[lightning]"
    python examples/lightning_trainer.py     # prints the run directory

CPU is enough: a few seconds.
"""

from __future__ import annotations

import argparse
import sys

import lightning
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from syncless.integrations.lightning import SynclessCallback


class LanguageModel(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(argv: list[str] | None = None, callbacks: tuple = ()) -> SynclessCallback:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--monitors", default="attention,activations,nonfinite,norms")
    parser.add_argument(
        "--on-nonfinite", default="warn", choices=("warn", "raise"),
        help="raise: a NaN/Inf stops training (the framework's own stop)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.randint(0, 128, (64, 32), generator=g), batch_size=2)
    syncless_callback = SynclessCallback(
        monitors=args.monitors, run_dir=args.run_dir, on_nonfinite=args.on_nonfinite
    )
    trainer = lightning.Trainer(
        max_steps=args.steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0,
        accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[syncless_callback, *callbacks],
    )  # fmt: skip
    trainer.fit(LanguageModel(), data)
    assert syncless_callback.run is not None
    print(syncless_callback.run.dir)
    return syncless_callback


if __name__ == "__main__":
    main(sys.argv[1:])
