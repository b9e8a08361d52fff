"""syncless's monitors in a Hugging Face Trainer, on a tiny Llama built from a config.

    pip install "syncless[transformers]"
    python examples/hf_trainer.py            # prints the run directory
    syncless query RUN_DIR "SELECT step, value FROM metrics WHERE name = 'monitors/global/attn_qk_logit_max'"

CPU is enough: a few seconds. On a GPU the Trainer uses it (bf16 with --bf16).
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from syncless.integrations.transformers import SynclessCallback


class RandomTokens(torch.utils.data.Dataset):
    """Random token sequences, labels = inputs (a language-model loss)."""

    def __init__(self, n: int, length: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None, callbacks: tuple = ()) -> SynclessCallback:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=2, help="gradient accumulation")
    parser.add_argument("--output-dir", default="runs/hf-trainer-output")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--monitors", default="attention,activations,nonfinite,norms")
    parser.add_argument(
        "--on-nonfinite", default="warn", choices=("warn", "raise"),
        help="raise: a NaN/Inf stops training (the framework's own stop)",
    )  # fmt: skip
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args(argv)

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    syncless_callback = SynclessCallback(
        monitors=args.monitors, run_dir=args.run_dir, on_nonfinite=args.on_nonfinite
    )
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=args.accumulate, learning_rate=1e-3, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to=[], bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=RandomTokens(64, 32, config.vocab_size),
        callbacks=[syncless_callback, *callbacks],
    )
    trainer.train()
    assert syncless_callback.run is not None
    print(syncless_callback.run.dir)
    return syncless_callback


if __name__ == "__main__":
    main(sys.argv[1:])
