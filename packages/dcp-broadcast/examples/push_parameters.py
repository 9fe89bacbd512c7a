"""Push a model's parameters from one rank to every other rank; no checkpoint involved.

    torchrun --standalone --nproc-per-node 4 packages/dcp-broadcast/examples/push_parameters.py
"""

import torch
import torch.distributed as dist
from dcp_broadcast import BroadcastItem, broadcast_items
from dcp_platform import get_platform


def push_parameters(model: torch.nn.Module, src: int = 0):
    """Overwrite every rank's parameters and buffers with those of rank ``src``, in place."""
    platform = get_platform("torch")
    everyone = tuple(range(platform.world_size()))
    items = [
        BroadcastItem(src, everyone, t.numel() * t.element_size(), t)
        for t in model.state_dict().values()  # these share storage with the model
    ]
    return broadcast_items(platform, items)


def main() -> None:
    started_here = not dist.is_initialized()  # under torchrun; a running job keeps its own group
    if started_here:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)  # every rank starts with different weights
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    stats = push_parameters(model, src=0)
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    sums = [None] * dist.get_world_size()
    dist.all_gather_object(sums, checksum)
    assert len(set(sums)) == 1, f"ranks disagree after the push: {sums}"
    if rank == 0:
        print(f"{stats.items} tensors sent in {stats.broadcasts} broadcast(s), "
              f"{stats.bytes_sent} bytes, {stats.seconds * 1e3:.1f} ms; all ranks hold rank 0's weights")
    if started_here:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
