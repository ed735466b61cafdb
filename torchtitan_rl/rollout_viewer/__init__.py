"""The rollout viewer: reads the rollout and evaluation dumps of an RL run (no torch), selects,
filters and sorts their records, and shows them as a terminal table or a self-contained HTML page
(``scripts/show_rollouts.py``)."""
