# SPDX-License-Identifier: MIT
"""The numeric helpers DeepEP's tests import (written for epd from their
documented behaviour)."""


def ceil_div(x, y):
    return (x + y - 1) // y


def align(x, y):
    return ceil_div(x, y) * y


def safe_div(a, b):
    if b == 0:
        if a == 0:
            return 0
        raise ZeroDivisionError(f"{a} / 0")
    return a / b


def calc_diff(x, y):
    """1 - cosine-like similarity of x + 1 and y + 1 (0 when equal)."""
    x, y = x.double() + 1, y.double() + 1
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


def per_token_cast_to_fp8(x, round_scale=False, skip_nan=False,
                          one_div=False):
    """[m, n] -> (e4m3 [m, n], fp32 scales [m, ceil(n/128)]): each group
    of 128 columns scaled so that its largest magnitude is 448 (amax at
    least 1e-4; scale amax * (1 / 448), values times 448 / amax). With
    round_scale (epd's addition, as DeepEP's low-latency
    cast) the scale amax / 448 is rounded up to a power of two and the
    values are multiplied by its inverse. skip_nan (epd's): NaNs take no
    part in amax, as in the low-latency kernels (DeepEP's and epd's take
    the max with fmaxf), so a row with a NaN keeps its other values.
    one_div (epd's): the multiplier 448 / amax as one correctly rounded
    division, as the low-latency kernels (DeepEP's and epd's) compute it;
    without it, as DeepEP's Python helper, torch's 448.0 / amax, which is
    reciprocal(amax) * 448 (rounded twice: the last bit differs for about
    a quarter of the values)."""
    import torch
    m, n = x.shape
    pad = align(n, 128) - n
    xp = torch.nn.functional.pad(x, (0, pad)).view(m, (n + pad) // 128, 128)
    mag = xp.abs().float()
    if skip_nan:
        mag = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag)
    amax = mag.amax(dim=2).clamp(min=1e-4)
    scale, mul = fp8_scale(amax, round_scale, one_div)
    q = (xp.float() * mul.unsqueeze(2)).to(torch.float8_e4m3fn)
    return q.view(m, n + pad)[:, :n].contiguous(), scale


def fp8_scale(amax, round_scale=False, one_div=False):
    """Each group's scale and multiplier from its amax (fp32, at least
    1e-4): see per_token_cast_to_fp8."""
    import torch
    if round_scale:
        # amax * fl(1/448), as DeepEP's kernel (and epd's): the same bits on
        # the CPU and the GPU (a GPU's amax / 448.0 is that product too),
        # rounded up to a power of two
        bits = (amax * (1.0 / 448.0)).view(torch.int32)
        up = ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = (((bits >> 23) + up) << 23).view(torch.float32)
        return scale, 1.0 / scale
    # the scale as a product (as DeepEP's kernels and PyTorch on a GPU
    # compute amax / 448.0): the same bits on the CPU and the GPU
    scale = amax * (1.0 / 448.0)
    if one_div:  # a tensor by a tensor: one correctly rounded division
        return scale, torch.full_like(amax, 448.0) / amax
    return scale, 448.0 / amax  # torch: reciprocal(amax) * 448


def per_token_cast_back(x_fp8, x_scales):
    """Inverse of per_token_cast_to_fp8 (scales fp32, or int32 UE8M0 with
    the exponent byte in each lane), to bf16."""
    import torch
    if x_fp8.numel() == 0:
        return x_fp8.to(torch.bfloat16)
    m, n = x_fp8.shape
    if x_scales.dtype == torch.int32:
        x_scales = (x_scales.view(torch.uint8).to(torch.int32) << 23).view(
            torch.float32)
    pad = align(n, 128) - n
    xp = torch.nn.functional.pad(x_fp8.float(), (0, pad)).view(m, -1, 128)
    y = xp * x_scales.float().reshape(m, -1, 1)
    return y.view(m, -1)[:, :n].to(torch.bfloat16).contiguous()


def inplace_unique(x, num_slots):
    """Each row of x (values in [0, num_slots) or -1) becomes its distinct
    values in descending order, padded with -1."""
    import torch
    filled = x.masked_fill(x < 0, num_slots)
    present = torch.zeros((x.size(0), num_slots + 1), dtype=torch.bool,
                          device=x.device)
    present.scatter_(1, filled.long(), True)
    present = present[:, :num_slots]
    idx = torch.arange(num_slots, device=x.device).expand_as(present)
    vals = torch.where(present, idx, torch.full_like(idx, -1))
    vals = vals.sort(dim=1, descending=True).values
    x.fill_(-1)
    n = min(num_slots, x.size(1))
    x[:, :n] = vals[:, :n].to(x.dtype)


def create_grouped_scores(scores, group_idx, num_groups):
    import torch
    t, e = scores.shape
    mask = torch.zeros((t, num_groups), dtype=torch.bool, device=scores.device)
    mask.scatter_(1, group_idx, True)
    return (scores.view(t, num_groups, -1) * mask.unsqueeze(-1)).view(t, e)


def hash_tensor(t):
    return t.view(-1).view(__import__("torch").int32).sum().item()


def hash_tensors(*tensors):
    v = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            v ^= hash_tensors(*t)
        elif t is not None:
            v ^= hash_tensor(t)
    return v


def count_bytes(*tensors):
    n = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            n += count_bytes(*t)
        elif t is not None:
            n += t.numel() * t.element_size()
    return n
