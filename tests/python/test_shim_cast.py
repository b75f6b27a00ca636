# SPDX-License-Identifier: MIT
"""deep_ep.utils.math.fp8_scale, the scales and multipliers of the shim's
fp8 casts, against numpy's float32 arithmetic (each operation correctly
rounded), on any machine:
  - the scale is amax * fl(1/448), one product;
  - one_div (the low-latency path, as the kernels compute it): the
    multiplier is fl(448 / amax), one division;
  - without it (DeepEP's Python helper): torch's 448.0 / amax, that is
    fl(fl(1 / amax) * 448), which differs in the last bit for a good share
    of the values (so that the low-latency path taking it would be seen);
  - round_scale: the scale is the least power of two at or above
    amax * fl(1/448), the multiplier its exact inverse.
Where torch has float8_e4m3fn, the cast itself is checked too: the values
times the multiplier, rounded to e4m3."""
import sys

import numpy as np
import torch

from epd.deep_ep.utils.math import fp8_scale, per_token_cast_to_fp8


def eq(t, n):
    """A torch float32 tensor and a numpy array, bit for bit."""
    return np.array_equal(t.numpy().view(np.uint32),
                          n.astype(np.float32).view(np.uint32))


def main():
    rng = np.random.default_rng(20261205)
    a = np.concatenate([
        (10.0 ** rng.uniform(-4, 4, 20000)).astype(np.float32),
        np.float32([1e-4, 1.0, 448.0, 0.5, 3.0, 7.0, 65504.0, 1e-4 * 3])])
    amax = torch.from_numpy(a.copy())
    inv448 = np.float32(1.0 / 448.0)
    want_scale = a * inv448
    f448 = np.float32(448.0)
    want_div = f448 / a
    want_rcp = (np.float32(1.0) / a) * f448
    s, m = fp8_scale(amax, False, True)
    assert eq(s, want_scale), "scale: amax * fl(1/448)"
    assert eq(m, want_div), "one_div: fl(448 / amax)"
    s, m = fp8_scale(amax, False, False)
    assert eq(s, want_scale), "scale without one_div"
    assert eq(m, want_rcp), "without one_div: fl(fl(1 / amax) * 448)"
    differ = float(np.mean(want_div != want_rcp))
    assert differ > 0.05, ("the two multipliers should differ", differ)
    s, m = fp8_scale(amax, True, False)
    sn = s.numpy()
    mant, _ = np.frexp(sn)
    assert np.all(mant == 0.5), "round_scale: a power of two"
    assert np.all(sn >= want_scale) and np.all(sn / 2 < want_scale), \
        "round_scale: the least power of two at or above amax / 448"
    assert eq(m, np.float32(1.0) / sn) and np.all(m.numpy() * sn == 1.0), \
        "round_scale: the multiplier is the scale's exact inverse"
    print(f"ok: fp8 scales and multipliers bitwise (20,008 groups; the "
          f"double-rounded multiplier differs in {differ:.0%} of them)")
    if not hasattr(torch, "float8_e4m3fn"):
        print("skip: the cast itself (no float8_e4m3fn in this torch)")
        return 0
    x = torch.from_numpy(rng.standard_normal((16, 512)).astype(np.float32))
    x = x * torch.from_numpy(
        (10.0 ** rng.uniform(-3, 3, (16, 1))).astype(np.float32))
    for rnd in (False, True):
        q, s = per_token_cast_to_fp8(x, rnd, one_div=True)
        am = x.view(16, 4, 128).abs().amax(dim=2).clamp(min=1e-4)
        _, m = fp8_scale(am, rnd, True)
        want = (x.view(16, 4, 128) * m.unsqueeze(2)).to(torch.float8_e4m3fn)
        assert torch.equal(q.view(torch.uint8),
                           want.view(16, 512).view(torch.uint8)), rnd
    print("ok: per_token_cast_to_fp8 (one_div) is the values times the "
          "multiplier, rounded to e4m3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
