"""Rank side of the GuardedTrainer tests: a tiny Llama, a tiny token dataset, the stock and the
guarded Trainer built alike (importable by name for the launch harness and the torchrun job)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

SEQ = 12
VOCAB = 64


def rank_environment(rank: int, world_size: int) -> None:
    """What the Trainer reads to join the (already initialised) process group, offline."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29500"),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )


def tiny_llama() -> torch.nn.Module:
    """The same tiny LlamaForCausalLM on every call (built from a config, a fixed seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


class TokenData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token ids whose labels are -100 over a prefix of varying length (a prompt), so the
    label-token count differs per sample, per micro-batch and per rank."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        prompt = torch.randint(0, SEQ - 2, (n,), generator=g)
        self.labels = self.ids.clone()
        self.labels[torch.arange(SEQ)[None, :] < prompt[:, None]] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def training_args(output_dir: str, **overrides: Any) -> Any:
    """The arguments both trainers share: CPU, gloo, GA 2, clipping that bites, a linear schedule."""
    from transformers import TrainingArguments

    kwargs: dict[str, Any] = {
        "output_dir": output_dir,
        "use_cpu": True,
        "ddp_backend": "gloo",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "average_tokens_across_devices": True,
        "max_steps": 6,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "linear",
        "max_grad_norm": 0.5,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "dataloader_num_workers": 0,
        "seed": 3,
        "disable_tqdm": True,
    }
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, flattened into one float64 vector (in the model's order)."""
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def logged(history: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The per-step log lines (loss, grad_norm, learning rate, step)."""
    keys = ("step", "loss", "grad_norm", "learning_rate")
    return [{k: float(h[k]) for k in keys} for h in history if "loss" in h and "grad_norm" in h]


def run_pair_and_resume(ctx: Any, workdir: str) -> dict[str, Any]:
    """Rank part of the equivalence and resume tests: the stock Trainer and the GuardedTrainer
    on the same data; then a guarded run checkpointing at step 2, resumed in a fresh trainer."""
    rank_environment(ctx.rank, ctx.world_size)
    from transformers import Trainer, TrainerCallback

    from replicheck.guard import GuardConfig
    from replicheck.integrations.transformers import GuardedTrainer

    torch.set_num_threads(1)
    data = TokenData(48)
    out: dict[str, Any] = {}
    cfg = GuardConfig(verify_every=2)

    stock = Trainer(model=tiny_llama(), args=training_args(f"{workdir}/stock"), train_dataset=data)
    stock.train()
    out["stock"] = {
        "weights": flat_weights(stock.model),
        "log": logged(stock.state.log_history),
        "global_step": stock.state.global_step,
    }

    class Steps(TrainerCallback):
        """The guard's next step after every optimizer step."""

        def __init__(self) -> None:
            self.trainer: GuardedTrainer | None = None
            self.seen: list[int] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            assert self.trainer is not None and self.trainer.guard is not None
            self.seen.append(self.trainer.guard.next_step)

    def guarded(output_dir: str, **overrides: Any) -> tuple[GuardedTrainer, Steps]:
        steps = Steps()
        trainer = GuardedTrainer(
            model=tiny_llama(),
            args=training_args(output_dir, **overrides),
            train_dataset=data,
            guard_config=cfg,
            callbacks=[steps],
            exit_on_corruption=False,
        )
        steps.trainer = trainer
        return trainer, steps

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, steps = guarded(f"{workdir}/guarded")
        trainer.train()
    assert trainer.guard is not None
    out["guarded"] = {
        "weights": flat_weights(trainer.model),
        "log": logged(trainer.state.log_history),
        "global_step": trainer.state.global_step,
        "next_step": steps.seen,
        "last_verified": trainer.guard.last_verified_step,
        "optimizer_restored": type(trainer.optimizer).__name__,
        "warnings": [str(w.message) for w in caught],
    }

    # A compute_loss of the user's own, a per-micro-batch mean (loss_is_scaled_for_ga = False).
    def mean_loss(self: Any, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        return model(input_ids=inputs["input_ids"], labels=inputs["labels"]).loss

    mean_args = {"max_steps": 4}
    stock_mean = type("MeanTrainer", (Trainer,), {"compute_loss": mean_loss, "loss_is_scaled_for_ga": False})(
        model=tiny_llama(), args=training_args(f"{workdir}/stock-mean", **mean_args), train_dataset=data
    )
    stock_mean.train()
    guarded_mean = type(
        "MeanGuarded", (GuardedTrainer,), {"compute_loss": mean_loss, "loss_is_scaled_for_ga": False}
    )(
        model=tiny_llama(),
        args=training_args(f"{workdir}/guarded-mean", **mean_args),
        train_dataset=data,
        guard_config=cfg,
    )
    guarded_mean.train()
    assert guarded_mean.guard is not None
    out["mean"] = {
        "stock": flat_weights(stock_mean.model),
        "guarded": flat_weights(guarded_mean.model),
        "stock_log": logged(stock_mean.state.log_history),
        "guarded_log": logged(guarded_mean.state.log_history),
        "reduction": guarded_mean.guard.config.loss_reduction,
    }

    ckpt = f"{workdir}/resume"
    whole, _ = guarded(ckpt, max_steps=4, save_strategy="steps", save_steps=2)
    whole.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, steps = guarded(ckpt, max_steps=4, save_strategy="no")
        resumed.train(resume_from_checkpoint=f"{ckpt}/checkpoint-2")
    out["resume"] = {
        "whole": flat_weights(whole.model),
        "resumed": flat_weights(resumed.model),
        "saved_state": resumed._saved_state,
        "next_step": steps.seen,
        "files": sorted(p.name for p in Path(f"{ckpt}/checkpoint-2").iterdir()),
        "warnings": [str(w.message) for w in caught],
    }
    return out
