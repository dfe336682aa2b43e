"""The asynchronous-rollout experiment (bench/experiments/staleness.py), short: with rollouts 8 updates stale,
uncorrected PPO degrades below its starting accuracy while sequence-level TIS keeps learning, on three fixed seeds.

40 steps (about 40 s on 2 cores). The full run (200 steps, 3 seeds) gave at step 40: ppo 0.094-0.135, seq_tis
0.438-0.492, from 0.350 at step 0; the margins below are several times the seed spread (0.05).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "experiments"))
import rl_task as T  # noqa: E402
import staleness as S  # noqa: E402

STEPS, SEEDS, STALENESS = 40, 3, 8


@pytest.mark.slow
def test_stale_rollouts_break_uncorrected_ppo_and_sequence_tis_keeps_learning(tmp_path):
    T.load_or_train(tmp_path / "cache", T.ModelConfig(), seed=0)
    rows = S.run(S.jobs([STALENESS], ["ppo", "seq_tis"], SEEDS, STEPS, 3e-4, tmp_path / "cache", controls=()),
                 workers=2)
    final = S.final_accuracy(rows)
    start = {r["learner_accuracy"] for r in rows if r["step"] == 0}
    assert len(start) == 1 and abs(start.pop() - 0.35) < 0.03  # the supervised checkpoint, the same for every run
    ppo, tis = final[("ppo", STALENESS)], final[("seq_tis", STALENESS)]
    assert len(ppo) == len(tis) == SEEDS
    assert max(ppo) < 0.25, ppo  # degraded: below the start on every seed
    assert min(tis) > 0.38, tis  # still learning on every seed
    assert min(tis) - max(ppo) > 0.15, (ppo, tis)
    # the mismatch the correction sees: the stale sampler's logprobs against the learner's, k3 well above bf16's
    k3 = [r["mismatch_k3"] for r in rows if r.get("mismatch_k3") is not None and r["step"] >= STALENESS]
    assert min(k3) > 1e-3
