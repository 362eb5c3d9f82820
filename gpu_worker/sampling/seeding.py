"""Per-row uniforms for the sampler's draws: SplitMix64 of (seed, output_count) in int64
tensor ops, so a row's draw depends on nothing else (not the batch, not the device)."""
from __future__ import annotations

import torch
from torch import Tensor


def _i64(x: int) -> int:
    """A 64-bit constant as the signed value torch's int64 ops accept (they wrap mod 2**64)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _xorshift_right_(z: Tensor, shift: int, tmp: Tensor) -> None:
    """z ^= z >>> shift (logical), in place. torch's >> is arithmetic on int64, so mask."""
    torch.bitwise_right_shift(z, shift, out=tmp)
    tmp.bitwise_and_((1 << (64 - shift)) - 1)
    z.bitwise_xor_(tmp)


def _mix64_(z: Tensor, tmp: Tensor, final: bool = True) -> Tensor:
    """SplitMix64's finaliser, in place. Without ``final`` only the top 33 bits are right."""
    _xorshift_right_(z, 30, tmp)
    z.mul_(_MIX1)
    _xorshift_right_(z, 27, tmp)
    z.mul_(_MIX2)
    if final:
        _xorshift_right_(z, 31, tmp)
    return z


def row_keys(seed: Tensor, output_count: Tensor) -> Tensor:
    """[B] int64 key of each row's draw: a function of (seed, output_count) only."""
    z = seed.to(torch.int64) + _GOLDEN
    tmp = torch.empty_like(z)
    _mix64_(z, tmp)
    # The state of a SplitMix64 stream seeded by mix(seed), advanced output_count + 1 times.
    z.add_((output_count.to(torch.int64) + 1).mul_(_GOLDEN))
    return _mix64_(z, tmp)


def row_uniform(seed: Tensor, output_count: Tensor) -> Tensor:
    """[B] float64 uniform in [0, 1) with 53 random bits, from (seed, output_count) only."""
    bits = torch.bitwise_right_shift(row_keys(seed, output_count), 11).bitwise_and_((1 << 53) - 1)
    return bits.to(torch.float64).mul_(2.0**-53)
