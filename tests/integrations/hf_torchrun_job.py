"""A GuardedTrainer job for ``torchrun --nproc-per-node 2``: rank 1's hardware corrupts a forward
activation from step ``onset`` on; the guard's next verification catches it and the job exits 87.

Usage: ``hf_torchrun_job.py INCIDENT_DIR OUTPUT_DIR ONSET``. Each worker names its node
``node<LOCAL_RANK>`` (``REPLICHECK_NODE``), as two single-GPU nodes would be named.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_trainer_ranks as ranks  # noqa: E402


def main(incident_dir: str, output_dir: str, onset: int) -> None:
    os.environ["REPLICHECK_NODE"] = f"node{os.environ['LOCAL_RANK']}"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from replicheck.faults import Fault
    from replicheck.guard import GuardConfig
    from replicheck.integrations.transformers import GuardedTrainer

    torch.set_num_threads(1)
    model = ranks.tiny_llama()
    fault = Fault.at_forward("model.layers.0.mlp").persistent(from_step=onset).scale(8.0, count=4).on_rank(1)
    fault.install(model, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    trainer = GuardedTrainer(
        model=model,
        args=ranks.training_args(output_dir),
        train_dataset=ranks.TokenData(48),
        guard_config=GuardConfig(verify_every=2, incident_dir=incident_dir),
    )
    trainer.train()  # exits 87 at the detection; reaching the end is the test's failure


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
