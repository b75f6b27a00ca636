# SPDX-License-Identifier: MIT
"""Process-group set-up as DeepEP's tests expect it, for epd.

init_dist picks NCCL when every local rank has a GPU of its own and gloo
when ranks share a GPU (NCCL refuses that) or there is no GPU;
EPD_DEEP_EP_DIST_BACKEND overrides."""
import os
import random

_local_rank = 0
_seed = 0


def init_seed(global_seed):
    import torch
    global _seed
    _seed = global_seed
    local = global_seed + _local_rank
    random.seed(local)
    torch.manual_seed(local)


def get_local_seed():
    return _seed + _local_rank


def get_global_seed():
    return _seed


def dist_print(s="", once_in_node=False):
    import torch.distributed as dist
    if not once_in_node or _local_rank == 0:
        print(s, flush=True)
    if dist.is_initialized():
        dist.barrier()


def _backend(num_local_ranks):
    import torch
    env = os.environ.get("EPD_DEEP_EP_DIST_BACKEND")
    if env:
        return env
    if torch.cuda.is_available() and \
            torch.cuda.device_count() >= num_local_ranks:
        return "nccl"
    return "gloo"


def _stacked_all_gather(dist):
    """torch documents two outputs of all_gather_into_tensor: the inputs
    concatenated along dim 0, or stacked ([world, *input.shape]). NCCL
    takes both; gloo only the first. DeepEP's tests pass the stacked one,
    so on a gloo group (ranks sharing a GPU) it goes in as its
    concatenated view (the same memory)."""
    orig = dist.all_gather_into_tensor
    if getattr(orig, "_epd_stacked", False):
        return

    def all_gather_into_tensor(output_tensor, input_tensor, group=None,
                               async_op=False):
        if (output_tensor.dim() == input_tensor.dim() + 1 and
                input_tensor.dim() > 0 and output_tensor.is_contiguous() and
                dist.get_backend(group) == "gloo"):
            output_tensor = output_tensor.view(-1, *input_tensor.shape[1:])
        return orig(output_tensor, input_tensor, group=group,
                    async_op=async_op)

    all_gather_into_tensor._epd_stacked = True
    dist.all_gather_into_tensor = all_gather_into_tensor


def init_dist(local_rank, num_local_ranks, seed=0):
    """(rank, world size, a group of every rank). MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE (nodes) and RANK (this node) as DeepEP's tests use them."""
    import torch
    import torch.distributed as dist
    global _local_rank
    _local_rank = local_rank
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    nodes = int(os.getenv("WORLD_SIZE", 1))
    node = int(os.getenv("RANK", 0))
    backend = _backend(num_local_ranks)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend=backend,
                            init_method=f"tcp://{ip}:{port}",
                            world_size=nodes * num_local_ranks,
                            rank=node * num_local_ranks + local_rank)
    if backend == "gloo":
        _stacked_all_gather(dist)
    if torch.cuda.is_available():
        torch.set_default_dtype(torch.bfloat16)
        if hasattr(torch, "set_default_device"):
            torch.set_default_device("cuda")
    init_seed(seed)
    return (dist.get_rank(), dist.get_world_size(),
            dist.new_group(list(range(nodes * num_local_ranks))))


def get_physical_domain_size(group):
    """(ranks per node, nodes) of the group, from the hosts' names."""
    import socket
    import torch.distributed as dist
    names = [None] * group.size()
    dist.all_gather_object(names, socket.gethostname(), group)
    per = names.count(names[0])
    return per, group.size() // per


def get_logical_domain_size(group, allow_hybrid_mode=True):
    return get_physical_domain_size(group)


def check_nvlink_connections(group):
    """epd's daemon owns the node's GPU memory: nothing to check here."""


def check_torch_deterministic():
    """epd's ops are bitwise deterministic whatever torch's setting."""
