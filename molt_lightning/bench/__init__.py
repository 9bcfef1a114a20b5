"""molt-bench: matched protocols over seeds, importers for runs made elsewhere, a named statistical verdict.

- ``protocol``: protocol YAML files, fingerprints, the mismatch check.
- ``runs``: the on-disk run set (manifest + one normalised metrics CSV per seed).
- ``stacks``: what ``run`` can run here (molt async, molt sync, TRL's GRPOTrainer).
- ``importers``: Lightning CSV, JSONL, TensorBoard, W&B CSV, with per-stack column maps (slime, NeMo-RL, verl, ...).
- ``summaries``: one number per seed (final value, mean, area under the curve) and curves on a common horizon.
- ``stats``: Welch, Mann-Whitney, TOST, IQM and probability of improvement with bootstrap CIs, power analysis, and
  the verdict rule (documented there, with the calibration numbers the tests check).
- ``compare``, ``report``: the comparison and its markdown/HTML/PNG report. ``cli``: the ``molt-bench`` command.

Nothing here imports torch at import time; only ``run`` does.
"""
