"""``RolloutSamples``: every ``every_n_steps`` steps, append a few trained trajectories, decoded, to a JSONL file.

Each line: step, sample id, reward, status, the trajectory's ``info`` (what the agent reported: the answer read, a
judge's prompt, raw verdicts and score, the rule verifier's score; values JSON cannot hold are written as text), and
the spans in order with their kind (prompt / policy / env), text and, for policy spans, the versions that sampled
them: what the policy saw and did, as it was trained on.
"""

from __future__ import annotations

import json
import os

import lightning as L


class RolloutSamples(L.Callback):
    def __init__(self, every_n_steps: int = 10, per_step: int = 2, filename: str = "rollouts.jsonl"):
        self.every_n_steps, self.per_step, self.filename = every_n_steps, per_step, filename

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = pl_module.policy_version - 1
        if step % self.every_n_steps or trainer.global_rank != 0 or trainer.logger is None:
            return
        decode = pl_module.tokenizer.decode
        os.makedirs(trainer.logger.log_dir, exist_ok=True)
        with open(os.path.join(trainer.logger.log_dir, self.filename), "a") as f:
            for traj in outputs["record"].batch.trajectories[: self.per_step]:
                spans = [{"kind": s.kind.value, "text": decode(s.token_ids),
                          **({"versions": sorted(set(s.versions))} if s.versions else {})}
                         for seg in traj.segments for s in seg]
                f.write(json.dumps({"step": step, "sample_id": traj.sample_id, "reward": traj.reward,
                                    "status": traj.status.value, "info": traj.info, "segments": len(traj.segments),
                                    "spans": spans}, default=str) + "\n")
