"""A small Hugging Face Trainer script as users write it (a tiny Llama from its config, no download).

`--save-steps N` saves a checkpoint every N steps into `--output` (the Trainer's own checkpoint-<step> folders, with
the optimizer, scheduler and RNG states); `--resume DIR` resumes from one, as `Trainer.train(resume_from_checkpoint)`
does for every Hugging Face user.
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, length: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 128, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--output", default="hf-out")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    training = TrainingArguments(output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=4,
                                 learning_rate=1e-3, logging_steps=1, report_to=[],
                                 save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
                                 use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=training, train_dataset=Tokens(64, 16)).train(resume_from_checkpoint=args.resume)


if __name__ == "__main__":
    main()
