"""Two ordinary DDP scripts whose ranks keep state of their own (issue: state that differs
across DDP ranks comes back to each rank).

``--model bn``: an MLP with four ``BatchNorm1d`` layers, ``strategy="ddp"``; each rank updates
its running statistics in its own forward (DDP broadcasts rank 0's at the start of the next).
``--model rl``: an actor-critic under manual optimization (two optimizers) whose ranks sample
their own rollouts and keep their own experience buffer and running reward statistics in
registered buffers that nothing synchronizes.

Every rank appends its per-step losses to ``{root}/losses.rank{r}`` and, at the end of
training, writes ``{root}/final.rank{r}.pt``: its whole ``state_dict`` (buffers included) and
the model's output in eval mode on a fixed batch. ``--kill-at-step N`` SIGKILLs every rank at
the end of step N (before that step's save); the same command then resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from harness.callbacks import KillAt  # noqa: E402

from areal_lightning import RecoverCallback  # noqa: E402


class Points(Dataset):
    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 8, generator=g) * 3 + 1
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def log_loss(root: Path, rank: int, step: int, loss: torch.Tensor) -> None:
    with open(root / f"losses.rank{rank}", "a") as f:
        f.write(json.dumps({"step": step, "loss": loss.item().hex(), "rank": rank}) + "\n")


class BNNet(pl.LightningModule):
    def __init__(self, root: Path, optimizer: str = "adamw") -> None:
        super().__init__()
        self.root, self.optimizer = root, optimizer
        layers: list[nn.Module] = []
        width = 8
        for _ in range(4):
            layers += [nn.Linear(width, 16), nn.BatchNorm1d(16), nn.ReLU()]
            width = 16
        self.net = nn.Sequential(*layers, nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        log_loss(self.root, self.global_rank, self.global_step + 1, loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer == "zero":  # ZeRO-1: each rank keeps the optimizer state of its own partition
            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def probe(self) -> torch.Tensor:
        return self.net(torch.linspace(-2, 2, 8 * 6).reshape(6, 8))


class Critic(nn.Module):
    """A value network that keeps an EMA of its own (per-rank) value estimates in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.register_buffer("value_ema", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ActorCritic(pl.LightningModule):
    """Manual optimization; each rank samples its own rollouts (its generator is seeded by rank)
    and keeps them and its reward statistics in registered buffers nothing synchronizes (also one
    inside the critic, which ``compile_critic`` wraps in ``torch.compile``)."""

    def __init__(self, root: Path, compile_critic: bool = False) -> None:
        super().__init__()
        self.root = root
        self.automatic_optimization = False
        self.actor = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        critic = Critic()
        self.critic = torch.compile(critic, backend="eager") if compile_critic else critic
        self.register_buffer("experience", torch.zeros(32, 8))
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))
        self.register_buffer("reward_mean", torch.zeros(()))
        self.register_buffer("reward_var", torch.ones(()))
        self.reward_metric = torchmetrics.MeanMetric()  # this rank's rewards (no sync before compute)
        self.reward_metric.persistent(True)  # its states in the state_dict, as a user keeps a metric's progress

    def on_train_start(self) -> None:
        if int(self.filled) == 0:  # a fresh start (a resume brings the buffers back)
            self.experience += self.global_rank  # each rank's buffer differs from the start

    def training_step(self, batch, batch_idx):
        x, _ = batch
        actor_opt, critic_opt = self.optimizers()
        # the rollout: each rank's own sample, from the RNG the checkpoint restores per rank
        noise = torch.randn_like(x) * (1 + self.global_rank)
        states = x + noise
        reward = states.sum(dim=1).detach()
        with torch.no_grad():
            self.reward_mean.mul_(0.9).add_(0.1 * reward.mean())
            self.reward_var.mul_(0.9).add_(0.1 * reward.var())
            slot = int(self.filled) % self.experience.shape[0]
            self.experience[slot: slot + len(states)] = states[: self.experience.shape[0] - slot]
            self.filled += 1
        self.reward_metric.update(reward)
        replay = torch.cat([states, self.experience[:4]])
        advantage = ((reward - self.reward_mean - self.critic.value_ema) / self.reward_var.sqrt()).detach()
        value = self.critic(replay).squeeze(-1)
        with torch.no_grad():
            self.critic.value_ema.mul_(0.9).add_(0.1 * value.mean())
        critic_loss = nn.functional.mse_loss(value[: len(reward)], advantage)
        critic_opt.zero_grad()
        self.manual_backward(critic_loss)
        critic_opt.step()
        logp = torch.log_softmax(self.actor(states), dim=-1)[:, 0]
        actor_loss = -(logp * advantage).mean()
        actor_opt.zero_grad()
        self.manual_backward(actor_loss)
        actor_opt.step()
        log_loss(self.root, self.global_rank, self.global_step // 2, actor_loss + critic_loss)

    def configure_optimizers(self):
        return torch.optim.Adam(self.actor.parameters(), lr=3e-3), torch.optim.Adam(self.critic.parameters(), lr=3e-3)

    def probe(self) -> torch.Tensor:
        return self.actor(torch.linspace(-2, 2, 8 * 6).reshape(6, 8))


class Final(pl.Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        pl_module.eval()
        with torch.no_grad():
            probe = pl_module.probe()
        pl_module.train()
        state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        torch.save({"state": state, "probe": probe}, pl_module.root / f"final.rank{trainer.global_rank}.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True, type=Path)
    p.add_argument("--model", choices=["bn", "rl"], default="bn")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--freq-steps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--optimizer", choices=["adamw", "zero"], default="adamw")
    p.add_argument("--compile-critic", action="store_true")
    p.add_argument("--memory", action="store_true", help="the memory tier too (every step), in {root}/memory")
    args = p.parse_args()
    pl.seed_everything(0, verbose=False)
    model = BNNet(args.root, args.optimizer) if args.model == "bn" else ActorCritic(args.root, args.compile_critic)
    memory = {"root": str(args.root / "memory")} if args.memory else None
    recover = RecoverCallback(fileroot=str(args.root), experiment_name="e", trial_name="t",
                              freq_steps=args.freq_steps, memory=memory)
    callbacks: list = [Final(), recover]
    if args.kill_at_step is not None:  # with the memory tier: once the shared tier's copies in flight are committed
        callbacks.insert(0, KillAt(args.kill_at_step, settle=recover if args.memory else None))
    # two backward passes per step, each reaching one of the two networks: DDP must look for unused parameters
    strategy = "ddp" if args.model == "bn" else "ddp_find_unused_parameters_true"
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, DataLoader(Points(), batch_size=8, shuffle=True))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
