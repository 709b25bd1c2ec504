"""μP coordinate check (issue 5): per-layer activation changes are flat in width under MiniCPM's μP and grow
under the standard parameterisation (widths 64 ... 512, a few Adam steps, float32)."""

import pytest

from minicpm4_jax.config import ConfigError
from minicpm4_jax.train.mup import coord_check, coord_check_config

# one xdist worker computes the module's shared (expensive) fixture once (scripts/run_tests.sh: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("mup_coord_check")

WIDTHS = (64, 128, 256, 512)
SMALL = dict(seq_len=32, batch_size=4)


@pytest.fixture(scope="module")
def checks():
    return {mup: coord_check(WIDTHS, mup=mup, steps=3, **SMALL) for mup in (True, False)}


@pytest.mark.slow
def test_hidden_activation_changes_are_flat_in_width_under_mup(checks):
    mup = checks[True]
    for name in ("layer0", "layer1"):
        per_width = [mup[w][name][-1] for w in WIDTHS]
        ratio = per_width[-1] / per_width[0]
        # measured (2026-11-29, 4 steps on [8, 64] tokens): 0.94 (layer0), 0.93 (layer1) for 8x the width
        assert 0.7 < ratio < 1.4, (name, per_width)
    # the readout does not grow either (it shrinks with the tied head: logits ÷ width_mult)
    assert mup[512]["logits"][-1] <= 1.2 * mup[64]["logits"][-1]


@pytest.mark.slow
def test_activation_changes_grow_with_width_under_standard_parameterisation(checks):
    sp = checks[False]
    for name in ("layer0", "layer1", "logits"):
        per_width = [sp[w][name][-1] for w in WIDTHS]
        assert all(b > a for a, b in zip(per_width, per_width[1:])), (name, per_width)
        # measured (4 steps on [8, 64] tokens): 19x, 17x, 3.9x for 8x the width
        assert per_width[-1] / per_width[0] > 3.0, (name, per_width)
    # both parameterisations are the same model at the base width
    assert checks[True][64] == checks[False][64]


def test_coord_check_width_must_fit_heads():
    with pytest.raises(ConfigError, match="width=96"):
        coord_check_config(96, mup=True)
