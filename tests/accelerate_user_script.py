"""A user's own Accelerate script, written as Accelerate's examples/nlp_example.py is (its own
tiny model and data, ``Accelerator``, ``prepare``, a loop with ``accelerator.backward``), plus the
one line that runs a stratagem preset (``--strategy``). tests/test_accelerate_user.py launches it
with ``accelerate launch --config_file <exported yaml>``; it prints one JSON line per rank.

    accelerate launch --config_file fsdp2-local.accelerate.yaml tests/accelerate_user_script.py --strategy fsdp2
"""

import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

from backends.accelerate import stratagem_accelerator


class ToyBlock(torch.nn.Module):
    def __init__(self, width, dropout=0.0):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))


class ToyRegressor(torch.nn.Module):
    def __init__(self, features=16, width=384, depth=2, dropout=0.0):
        super().__init__()
        self.inp = torch.nn.Linear(features, width)
        self.blocks = torch.nn.Sequential(*(ToyBlock(width, dropout) for _ in range(depth)))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def get_dataloader(batch_size, n=64, features=16, own_generator=False):
    """``own_generator``: the DataLoader's own ``generator``, from which torch draws its iterator's
    base seed; without one that draw comes from the global RNG as the iterator starts -- after a
    ``load_state`` that restored it, so a resumed run's dropout masks differ (README)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(1024, features, generator=g)[:n]  # (the first samples the same for any n)
    y = x.sum(-1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False,
                      generator=torch.Generator() if own_generator else None)


def full_params(accelerator, model):
    """Whole tensors, gathered from the shards (ZeRO-3: the preset's config gathers on save, and
    DeepSpeed hands them to rank 0 only, as Accelerate documents)."""
    return accelerator.get_state_dict(model) or {}


def eval_loader_and_set(features=16):
    """10 held-out samples in batches of 4 (uneven across 2 ranks: ``gather_for_metrics`` drops
    the padding), and the whole set. Its own generator: iterating it draws nothing from the
    global RNG, so the training after an eval is the training without one."""
    g = torch.Generator().manual_seed(99)
    x = torch.randn(10, features, generator=g)
    y = x.sum(-1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False, generator=torch.Generator()), (x, y)


def evaluate(accelerator, model, loader, whole):
    """The script's eval loop (per-sample MSE through ``gather_for_metrics``, as Accelerate's
    examples score) without and inside ``accelerator.rank0_replica()``; this rank's own replica on
    the whole set (no collective); whether each parameter is its own again, bit for bit."""
    def score():
        per = []
        with torch.no_grad():
            for x, y in loader:
                per.append(accelerator.gather_for_metrics(((model(x) - y) ** 2).mean(-1)))
        return torch.cat(per).mean().item()

    model.eval()
    own = [p.detach().clone() for p in model.parameters()]
    mixed = score()
    with accelerator.rank0_replica():
        block = score()
    restored = all(torch.equal(a, p) for a, p in zip(own, model.parameters()))
    with torch.no_grad():
        alone = ((accelerator.unwrap_model(model)(whole[0]) - whole[1]) ** 2).mean().item()
    model.train()
    return {"mixed": mixed, "block": block, "own": alone, "restored": restored}


def training_function(args):
    acc = args.accumulation
    mine = {}  # the script's own Accelerator arguments, passed through the hook as they are
    if args.project_dir:  # save_state / load_state then name (and find) checkpoints/checkpoint_<n>
        mine["project_config"] = ProjectConfiguration(project_dir=args.project_dir,
                                                      automatic_checkpoint_naming=True)
    accelerator = (stratagem_accelerator(args.strategy, gradient_accumulation_steps=acc,
                                         grad_clip=args.clip if args.hook_clip else 0.0, **mine)
                   if args.strategy else Accelerator(cpu=args.cpu, gradient_accumulation_steps=acc, **mine))
    set_seed(42)
    model = ToyRegressor(dropout=args.dropout)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = (torch.optim.SGD(model.parameters(), lr=args.lr) if args.optimizer == "sgd"
                 else torch.optim.AdamW(model.parameters(), lr=args.lr))
    loader = get_dataloader(args.batch_size, args.samples, own_generator=args.loader_generator)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / 100) if args.sched else None
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if sched is not None:  # a decaying schedule, prepared in a call of its own (as many scripts do)
        sched = accelerator.prepare(sched)
    if args.eval_at:
        eval_loader, whole = eval_loader_and_set()
        eval_loader = accelerator.prepare(eval_loader)
    out = {"losses": [], "norms": [], "lrs": []}

    def train(batches, step, rec):
        for x, y in batches:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if args.clip and accelerator.sync_gradients:
                    rec["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), args.clip)))
                optimizer.step()
                if sched is not None:
                    sched.step()
                optimizer.zero_grad()
            if sched is not None and accelerator.sync_gradients:
                rec["lrs"].append(sched.get_last_lr()[0])
            rec["losses"].append(accelerator.gather(loss.detach()[None]).mean().item())
            step += 1
            if step == args.save_at and rec is out:
                accelerator.save_state(args.state_dir)
            if step == args.eval_at and rec is out:
                rec["eval"] = evaluate(accelerator, model, eval_loader, whole)
        return step

    step = 0
    if args.resume_at:  # as Accelerate's complete_nlp_example resumes: its state, then the batches left
        accelerator.load_state(args.state_dir)
        step = args.resume_at
    for epoch in range(args.epochs):
        model.train()
        step = train(accelerator.skip_first_batches(loader, step) if epoch == 0 and step else loader, step, out)
    params = {k: [v.float().sum().item(), v.float().norm().item()] for k, v in full_params(accelerator, model).items()}
    if args.reload:  # the state saved at --save_at loaded into this run, then the batches after it again
        accelerator.load_state(args.state_dir)
        out["again"] = {"losses": [], "norms": [], "lrs": []}
        train(accelerator.skip_first_batches(loader, args.save_at), args.save_at, out["again"])
        out["again"]["params"] = {k: [v.float().sum().item(), v.float().norm().item()]
                                  for k, v in full_params(accelerator, model).items()}
    held = accelerator.held_bytes(model, optimizer) if hasattr(accelerator, "held_bytes") else total
    units = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
    ddp = model._get_ddp_logging_data() if hasattr(model, "_get_ddp_logging_data") else {}
    line = json.dumps({"rank": accelerator.process_index, "world": accelerator.num_processes,
                       "distributed_type": accelerator.distributed_type.name,
                       "model_type": type(model).__name__, "fsdp_units": units,
                       "comm_hook": ddp.get("comm_hook"), "sched_type": type(sched).__name__,
                       "held_param_bytes": held, "total_param_bytes": total, **out, "params": params})
    for rank in range(accelerator.num_processes):  # in turn: two ranks' lines once ran together
        if rank == accelerator.process_index:
            print(line, flush=True)
        accelerator.wait_for_everyone()
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="A user's Accelerate script on a stratagem preset.")
    parser.add_argument("--strategy", default=None, help="a stratagem preset (the one-line hook)")
    parser.add_argument("--cpu", action="store_true", help="plain Accelerator on CPU (no hook)")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--clip", type=float, default=0.0, help="accelerator.clip_grad_norm_ at this max_norm")
    parser.add_argument("--state_dir", default=None, help="accelerator.save_state / load_state's directory")
    parser.add_argument("--project_dir", default=None,
                        help="ProjectConfiguration(automatic_checkpoint_naming=True): the states' home")
    parser.add_argument("--save_at", type=int, default=0, help="save_state after this many batches")
    parser.add_argument("--resume_at", type=int, default=0,
                        help="load_state first, then skip this many batches (the saved run's)")
    parser.add_argument("--hook_clip", action="store_true", help="and the hook's grad_clip (DeepSpeed)")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout in each block")
    parser.add_argument("--sched", action="store_true",
                        help="a decaying LambdaLR, prepared in its own accelerator.prepare call after the model's")
    parser.add_argument("--eval_at", type=int, default=0,
                        help="after this many batches, the eval loop without and inside accelerator.rank0_replica()")
    parser.add_argument("--reload", action="store_true",
                        help="at the end, load_state(--state_dir) and train the batches after --save_at again")
    parser.add_argument("--loader_generator", action="store_true",
                        help="the DataLoader's own generator (a resumed run's dropout then equals the straight run's)")
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
