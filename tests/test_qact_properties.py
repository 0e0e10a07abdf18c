"""Properties of QACT [QACT, eqs. (4)-(6)] checked with hypothesis on random contexts."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftguard.functional import quantile_activation
from shiftguard.nn import QuantileActivation

SETTINGS = settings(max_examples=15, deadline=None)


@st.composite
def contexts(draw, max_n=24, max_c=3):
    n = draw(st.integers(1, max_n))
    c = draw(st.integers(1, max_c))
    # multiples of 1/8 in [-50, 50]: distinct values stay distinct (and zeros stay zero) under any
    # scaling a >= 0.05, so rounding cannot create ties the exact maths does not have
    values = draw(st.lists(st.integers(-400, 400), min_size=n * c, max_size=n * c))
    return torch.tensor(values, dtype=torch.float64).reshape(n, c) / 8


def _g():
    return torch.Generator().manual_seed(0)


@SETTINGS
@given(contexts())
def test_output_lies_in_unit_interval(x):
    out = quantile_activation(x, generator=_g())
    assert out.min() >= 0 and out.max() <= 1


@SETTINGS
@given(contexts())
def test_output_is_monotone_in_the_input_within_a_channel(x):
    out = quantile_activation(x, generator=_g())
    for ch in range(x.shape[1]):
        order = torch.argsort(x[:, ch])
        assert torch.all(out[order, ch][1:] >= out[order, ch][:-1])


@SETTINGS
@given(contexts(), st.floats(0.05, 1.9))
def test_unchanged_when_a_channel_is_scaled_by_a_positive_factor(x, a):
    # values stay inside (-c, c) = (-100, 100): |50 * 1.9| < 100
    scaled = x.clone()
    scaled[:, 0] *= a
    torch.testing.assert_close(
        quantile_activation(scaled, generator=_g()), quantile_activation(x, generator=_g()), rtol=0, atol=0
    )


@SETTINGS
@given(contexts(max_n=16), st.integers(0, 15))
def test_frozen_mode_gives_a_sample_the_same_output_alone_or_in_a_batch(x, i):
    i = i % x.shape[0]
    layer = QuantileActivation(num_features=x.shape[1]).double()
    layer.fit_context(torch.randn(64, x.shape[1], dtype=torch.float64))
    torch.testing.assert_close(layer(x[i : i + 1]), layer(x)[i : i + 1], rtol=0, atol=0)


@settings(SETTINGS, derandomize=True, database=None)
@given(contexts(max_n=16), st.integers(0, 15))
def test_batch_mode_output_depends_on_the_context(x, i):
    # One sample in two batches: once every other value of its channel lies below it, once above it
    # (offsets in [1/4, 25.25]: values stay inside (-c, c) = (-100, 100)). Its output is its quantile
    # level in the batch [QACT, eq. (4)], so it is strictly higher in the first batch, in every channel.
    sample = x[i % x.shape[0]]
    offsets = ((x - sample).abs() + 1) / 4
    below = torch.cat([sample[None], sample - offsets])
    above = torch.cat([sample[None], sample + offsets])
    out_below = quantile_activation(below, generator=_g())[0]
    out_above = quantile_activation(above, generator=_g())[0]
    assert torch.all(out_below > out_above), (out_below, out_above)
