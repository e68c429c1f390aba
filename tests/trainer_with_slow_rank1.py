"""vae_trainer.py with rank 1 arriving late at the run directory (a slow file system, a busy node): it
sleeps VAE_TEST_RANK1_DELAY_S seconds before the trainer looks for checkpoints. Test-only: the production
code has no hook for this. Run it under torchrun like vae_trainer.py."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint  # noqa: E402
import vae_trainer  # noqa: E402

if os.environ.get("RANK") == "1":
    find_resume = checkpoint.find_resume

    def late_find_resume(*args, **kwargs):
        time.sleep(float(os.environ.get("VAE_TEST_RANK1_DELAY_S", "3")))
        return find_resume(*args, **kwargs)

    checkpoint.find_resume = late_find_resume

if __name__ == "__main__":
    sys.exit(vae_trainer.main(give_back_signals=False))
