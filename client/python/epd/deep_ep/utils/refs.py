# SPDX-License-Identifier: MIT
"""Reference semantics of DeepEP V2's dispatch and combine, which V2's
tests compare ElasticBuffer against (written for epd from V2's documented
behaviour; plain torch and torch.distributed, no epd)."""
import math


def _dev_for(group_backend, t):
    """Where a collective of this backend takes t (gloo: the CPU)."""
    return t.cpu() if group_backend == "gloo" else t


def _take(t, rows):
    """t's rows (fp8 ones moved as bytes)."""
    import torch
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8)[rows].view(t.dtype)
    return t[rows]


def _a2a(dist, t, recv_counts, send_counts, backend):
    """all_to_all_single of rows (first dimension) with these splits; the
    types gloo does not move (bf16, fp8) go as bytes."""
    import torch
    plain = t.dtype in (torch.float32, torch.int32, torch.int64,
                        torch.uint8)
    b = t.contiguous() if plain or t.dim() == 0 else \
        t.contiguous().view(torch.uint8)
    src = _dev_for(backend, b)
    out = torch.empty((sum(recv_counts),) + tuple(b.shape[1:]),
                      dtype=b.dtype, device=src.device)
    dist.all_to_all_single(out, src, recv_counts, send_counts)
    out = out.to(t.device)
    return out if plain else out.view(t.dtype)


def dispatch(x, topk_idx, topk_weights, num_max_tokens_per_rank,
             num_experts):
    """Each rank receives, once, every token with one of its experts
    (expert e lives on rank e // (num_experts / world)), ordered by source
    rank then source token. Returns (recv_x (a pair (x, sf) for fp8),
    recv_topk_idx (local expert indices, -1 for other ranks' slots),
    recv_topk_weights (the token's whole row), recv_src_token_idx
    (source rank * num_max_tokens_per_rank + source token, int32),
    num_recv_tokens_per_rank (int32 [world], on the CPU))."""
    import torch
    import torch.distributed as dist
    rank, W = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    if num_experts % W:
        raise ValueError(f"{num_experts} experts over {W} ranks")
    per = num_experts // W
    fp8 = isinstance(x, tuple)
    x, sf = x if fp8 else (x, None)
    T = x.size(0)
    if topk_idx.size(0) != T or (sf is not None and sf.size(0) != T) or \
            (topk_weights is not None and
             topk_weights.shape != topk_idx.shape):
        raise ValueError("dispatch: inputs of different token counts")
    dest = torch.where(topk_idx >= 0, topk_idx // per,
                       torch.full_like(topk_idx, -1))
    sel, send = [], []
    for d in range(W):
        ids = (dest == d).any(dim=1).nonzero(as_tuple=True)[0]
        sel.append(ids)
        send.append(int(ids.numel()))
    order = torch.cat(sel)
    # the counts (small): every rank's row of the send matrix
    mat = [None] * W
    dist.all_gather_object(mat, send)
    recv_counts = [mat[s][rank] for s in range(W)]
    src_tok = (order.to(torch.int32) + rank * num_max_tokens_per_rank)
    rx = _a2a(dist, _take(x, order), recv_counts, send, backend)
    rsf = _a2a(dist, sf[order], recv_counts, send, backend) if fp8 else None
    rti = _a2a(dist, topk_idx[order], recv_counts, send, backend)
    w = topk_weights if topk_weights is not None else \
        torch.zeros(topk_idx.shape, dtype=torch.float32, device=x.device)
    rtw = _a2a(dist, w[order], recv_counts, send, backend)
    rsrc = _a2a(dist, src_tok, recv_counts, send, backend)
    lo = rank * per
    mine = (rti >= lo) & (rti < lo + per)
    rti = torch.where(mine, rti - lo, torch.full_like(rti, -1))
    return ((rx, rsf) if fp8 else rx, rti, rtw, rsrc,
            torch.tensor(recv_counts, dtype=torch.int32))


def generate_pre_combine_data(src_token_global_idx, num_max_tokens_per_rank,
                              num_topk, hidden):
    """Rows [tokens, num_topk, hidden] bf16 for combine tests: element
    (j, k) of token i is sin((s * 131071 mod m + 1) / m * (k + 1) +
    sin(seed)) with s = src_token_global_idx[i] * num_topk + j,
    m = world * num_max_tokens_per_rank * num_topk and seed the global
    seed (envs.init_seed)."""
    import torch
    import torch.distributed as dist
    from .envs import get_global_seed
    dev = src_token_global_idx.device
    m = dist.get_world_size() * num_max_tokens_per_rank * num_topk
    s = src_token_global_idx.to(torch.int64).unsqueeze(1) * num_topk + \
        torch.arange(num_topk, dtype=torch.int64, device=dev).unsqueeze(0)
    phase = ((s * 131071 % m).to(torch.float32) + 1) / m
    k = torch.arange(1, hidden + 1, dtype=torch.float32, device=dev)
    out = torch.sin(phase.unsqueeze(-1) * k.view(1, 1, hidden) +
                    math.sin(float(get_global_seed())))
    return out.to(torch.bfloat16)


def ordered_accumulate(data, initial_value=None):
    """data [tokens, k, hidden] summed over k in order, in fp32 from zero
    (or from initial_value [tokens, hidden]), to data's dtype."""
    import torch
    acc = torch.zeros((data.size(0), data.size(2)), dtype=torch.float32,
                      device=data.device) if initial_value is None \
        else initial_value.to(torch.float32).clone()
    for j in range(data.size(1)):
        acc += data[:, j, :].float()
    return acc.to(data.dtype)


def _grouped(y, gid):
    """Per token, each group's slots (equal gid) summed in slot order in
    fp32 from zero and rounded to y's dtype, at the group's last slot;
    the group's other slots zero."""
    import torch
    T, K, H = y.shape
    out = torch.zeros_like(y)
    zero = torch.zeros((), dtype=torch.float32, device=y.device)
    for j in range(K):
        same = gid == gid[:, j:j + 1]  # [T, K]: slots in j's group
        last = ~same[:, j + 1:].any(dim=1) if j + 1 < K else \
            torch.ones((T,), dtype=torch.bool, device=y.device)
        acc = torch.zeros((T, H), dtype=torch.float32, device=y.device)
        for i in range(j + 1):
            acc += torch.where(same[:, i:i + 1], y[:, i].float(), zero)
        out[:, j] = torch.where(last.unsqueeze(1), acc.to(y.dtype),
                                torch.zeros((), dtype=y.dtype,
                                            device=y.device))
    return out


def combine(y, topk_idx, num_scaleout_ranks, num_scaleup_ranks, num_experts,
            bias, reduce_in_local, reduce_in_scaleup):
    """The combined rows [tokens, hidden] of y [tokens, k, hidden] (each
    slot's expert output): with reduce_in_local, each rank's slots are
    first summed (fp32, rounded) at that rank's last slot; with
    reduce_in_scaleup, then each scale-up domain's; then every slot is
    added in slot order in fp32 from the bias (a pair: the first plus the
    second) and rounded once."""
    import torch
    if reduce_in_scaleup and not reduce_in_local:
        raise ValueError("reduce_in_scaleup needs reduce_in_local")
    W = num_scaleout_ranks * num_scaleup_ranks
    per = num_experts // W
    if reduce_in_local:
        y = _grouped(y, torch.div(topk_idx, per, rounding_mode="floor"))
    if reduce_in_scaleup:
        y = _grouped(y, torch.div(topk_idx, per * num_scaleup_ranks,
                                  rounding_mode="floor"))
    init = None
    if isinstance(bias, tuple):
        init = bias[0].float() + bias[1].float()
    elif bias is not None:
        init = bias.float()
    return ordered_accumulate(y, init)
