"""Train the character-level GPT with tensor parallelism x FSDP2 in plain PyTorch: what
train_tp.py does through Lite, written by hand. Start it with torchrun:

    torchrun --nproc-per-node 4 examples/gpt/train_tp_plain.py                          # dp1 x tp4
    torchrun --nproc-per-node 4 examples/gpt/train_tp_plain.py --data-parallel-size 2   # dp2 x tp2
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

from data_and_model import GPT, CharTokenizer, generate, make_dataset
from tensor_parallel import parallelize


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` for parameters on two meshes (the tensor-parallel ones on the 2-D mesh, the
    rest on the data-parallel submesh), which torch's own cannot stack: one norm per mesh, combined."""
    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault((p.grad.device_mesh, tuple(p.grad.placements)), []).append(p.grad)
    norms = [torch.nn.utils.get_total_norm(grads).full_tensor() for grads in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coefficient = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for grads in by_mesh.values():
        for grad in grads:
            grad.mul_(coefficient)
    return total


def train(args: argparse.Namespace) -> float:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = 1 if args.data_parallel_size == "auto" else int(args.data_parallel_size)
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(args.seed)
    tokenizer = CharTokenizer()
    model = parallelize(GPT(tokenizer.vocab_size, args.block_size), mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset = make_dataset(tokenizer, args.block_size)
    # Shard by data-parallel rank: the processes of one tensor-parallel group read the same batches.
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=mesh["data_parallel"].get_local_rank(),
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for tokens, targets in loader:
            optimizer.zero_grad()
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            clip_grad_norm(list(model.parameters()), max_norm=1.0)
            optimizer.step()
            step += 1
            if step % 50 == 0 or step == args.steps:
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                if rank == 0:
                    print(f"step {step}/{args.steps}  loss {mean.item() / world:.4f}")
            if step == args.steps:
                break
        epoch += 1

    model.eval()
    sample = generate(model, tokenizer.encode("The keeper"), 60, args.block_size)
    if rank == 0:
        print(f"sample: {tokenizer.decode(sample)!r}")
    final = loss.detach().clone()
    dist.all_reduce(final)
    dist.destroy_process_group()
    return final.item() / world


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="per data-parallel rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--data-parallel-size", default="auto", help="'auto': 1 (tensor parallel on every process)")
    return parser.parse_args()


if __name__ == "__main__":
    final_loss = train(parse_args())
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"final loss {final_loss!r}")
