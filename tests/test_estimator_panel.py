"""The seed's estimator facts, asserted exactly on an enumerable tabular policy (bench/experiments).

Sums over every sequence, no sampling: each assertion is a mathematical fact of the estimators as the
presets implement them (DESIGN.md section 2), so a sign or weight error in the loss breaks it.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "experiments"))
import estimator_panel as ep  # noqa: E402

LENGTHS = (2, 4, 6, 8)
MISMATCHES = (0.0, 0.25, 0.5, 1.0)


@pytest.fixture(scope="module")
def panel():
    """{(length, mismatch): {estimator: {bias, variance}}} for vocab 2, lengths 2-8."""
    out = {}
    for length in LENGTHS:
        task = ep.TabularTask(2, length, seed=0)
        for m in MISMATCHES:
            out[length, m] = ep.panel_for(task, m)
    return out


def test_no_mismatch_every_estimator_is_the_on_policy_gradient(panel):
    for length in LENGTHS:
        cell = panel[length, 0.0]
        variances = [cell[name]["variance"] for name in ep.ESTIMATORS]
        for name in ep.ESTIMATORS:
            assert cell[name]["bias"] < 1e-12, (length, name)
        assert max(variances) - min(variances) <= 1e-9 * max(variances)


def test_sequence_is_is_unbiased(panel):
    for (length, m), cell in panel.items():
        assert cell["sequence IS"]["bias"] < 1e-10, (length, m)


def test_token_is_is_biased_and_the_bias_grows_with_mismatch(panel):
    for length in LENGTHS:
        biases = [panel[length, m]["token IS"]["bias"] for m in MISMATCHES]
        assert biases[1] > 1e-3
        assert all(a < b for a, b in zip(biases, biases[1:])), (length, biases)


def test_sequence_is_variance_explodes_with_mismatch_and_length(panel):
    """Variance relative to the uncorrected estimator's: grows with mismatch (length >= 6) and with length
    (mismatch >= 0.5)."""
    def ratio(length, m):
        cell = panel[length, m]
        return cell["sequence IS"]["variance"] / cell["no correction"]["variance"]

    for length in (6, 8):
        ratios = [ratio(length, m) for m in MISMATCHES[1:]]
        assert all(a < b for a, b in zip(ratios, ratios[1:])), (length, ratios)
    for m in (0.5, 1.0):
        ratios = [ratio(length, m) for length in LENGTHS]
        assert all(a < b for a, b in zip(ratios, ratios[1:])), (m, ratios)
    assert ratio(8, 1.0) > 10.0


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_truncation_and_masking_trade_bias_for_variance(panel, level):
    """Where the cap binds (mismatch >= 0.5, length >= 4): TIS and MIS have less variance than plain IS
    and more bias than sequence IS (which has none)."""
    for length in LENGTHS[1:]:
        for m in (0.5, 1.0):
            cell = panel[length, m]
            plain = cell[f"{level} IS"]
            for kind in ("TIS", "MIS"):
                est = cell[f"{level} {kind}"]
                assert est["variance"] < plain["variance"] or (level == "token" and length <= 4 and m == 0.5 and
                                                               est["variance"] <= plain["variance"] * (1 + 1e-9)), \
                    (length, m, kind, est, plain)
                if level == "sequence":
                    assert est["bias"] > 100 * plain["bias"] + 1e-3, (length, m, kind)
