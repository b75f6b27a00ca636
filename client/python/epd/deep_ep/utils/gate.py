# SPDX-License-Identifier: MIT
"""Gate scores for DeepEP V2's tests: random scores whose top-k sends a
chosen share of the tokens to rank 0 (written for epd from V2's
documented behaviour)."""


def _device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rank0_ratio(scores, num_ranks, num_topk):
    """Tokens rank 0 receives over the mean of the other ranks'."""
    import torch
    T, E = scores.shape
    per = E // num_ranks
    idx = torch.topk(scores, num_topk, dim=-1, sorted=False).indices
    hit = torch.zeros((T, num_ranks), dtype=torch.bool, device=idx.device)
    hit.scatter_(1, torch.div(idx, per, rounding_mode="floor"), True)
    n = hit.sum(dim=0).to(torch.float32)
    return (n[0] / n[1:].mean().clamp(min=1e-9)).item()


def get_scores_by_factor(num_tokens, num_experts, num_ranks, factor):
    """Scores uniform in [0, 1), those of rank 0's experts in
    [0, factor): factor > 1 draws more tokens to rank 0."""
    import torch
    per = num_experts // num_ranks
    s = torch.rand((num_tokens, num_experts), dtype=torch.float32,
                   device=_device())
    s[:, :per] *= factor
    return s


def get_random_unbalanced_scores(num_tokens, num_experts, num_ranks,
                                 num_topk, ratio):
    """Scores whose top-k gives rank 0 about `ratio` times the tokens of
    any other rank (1.0: balanced): the factor of get_scores_by_factor
    found by bisection on trial draws."""
    if ratio < 1.0:
        raise ValueError(f"ratio {ratio} below 1")
    if ratio == 1.0 or num_ranks == 1:
        return get_scores_by_factor(num_tokens, num_experts, num_ranks, 1.0)
    lo, hi = 1.0, 100.0
    for _ in range(20):
        mid = (lo + hi) / 2
        s = get_scores_by_factor(num_tokens, num_experts, num_ranks, mid)
        if _rank0_ratio(s, num_ranks, num_topk) > ratio:
            hi = mid
        else:
            lo = mid
    return get_scores_by_factor(num_tokens, num_experts, num_ranks, lo)


def get_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk,
                          ratio, precise):
    if precise:
        raise NotImplementedError(
            "epd's deep_ep.utils.gate: precise unbalanced scores "
            "(--precise-unbalanced-ratio) are not provided")
    return get_random_unbalanced_scores(num_tokens, num_experts, num_ranks,
                                        num_topk, ratio)
