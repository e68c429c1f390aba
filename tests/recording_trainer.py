"""vae_trainer.py that records, per rank, the shape and a digest of every micro-batch each optimizer step trains on
(the multi-resolution tests compare shapes across ranks, the elastic tests the images across runs); the production
code has no hook for it. Run it like vae_trainer.py (plain python or under torchrun); VAE_TRAINER_RECORD names a
folder that receives batches_rank<R>.jsonl, one line {"step", "shapes", "digests", "first"} per step ("first": the
step's index of this rank's first micro-batch among the step's micro-batches of all ranks). A test's in-process run
records the same with monkeypatch.setattr(vae_trainer.Trainer, "train_step", recording_trainer.recording_train_step)
and VAE_TRAINER_RECORD in its environment."""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vae_trainer  # noqa: E402

train_step = vae_trainer.Trainer.train_step


def recording_train_step(self, batches=None):
    path = os.path.join(os.environ["VAE_TRAINER_RECORD"], f"batches_rank{self.info.rank}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"step": self.step, "shapes": [list(b.shape) for b in batches],
                            "digests": [hashlib.sha1(b.numpy().tobytes()).hexdigest() for b in batches],
                            "first": self.info.rank * len(batches)}) + "\n")
    train_step(self, batches)


if __name__ == "__main__":
    vae_trainer.Trainer.train_step = recording_train_step
    sys.exit(vae_trainer.main(give_back_signals=False))
