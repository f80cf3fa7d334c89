"""Tuning: the one regret, policies over baseline / sp / sp+async_tp, exported configs, per-matmul rules.

``sp_lab.tuning.regret_table(rows, config)`` is the regret every view shows (see :mod:`sp_lab.tuning.regret`);
:func:`sp_lab.tuning.policy.recommend` chooses a policy with the rows' noise in mind.
"""

from sp_lab.tuning.regret import regret_table

__all__ = ["regret_table"]
