"""vae_trainer.py with faults injected for the fault-tolerance tests; the production code has no hooks for them.
Run it like vae_trainer.py (plain python or under torchrun). Each variable names steps, optionally ranks:
'3,4@1' -> steps 3 and 4 on rank 1 (every rank without '@').

    VAE_TRAINER_INJECT_NAN        the VAE's loss is NaN at these steps
    VAE_TRAINER_INJECT_NAN_RECON  the reconstruction is NaN (what an fp16 decoder overflow gives): the critic sees it
    VAE_TRAINER_KILL_AT           SIGKILL before the step (once per run directory: not again after a restart)
    VAE_TRAINER_SIGTERM_AT        SIGTERM before the step (once per run directory)
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import objective  # noqa: E402
import vae_trainer  # noqa: E402
import train_state  # noqa: E402


def steps_from_env(name: str) -> set[int]:
    spec = os.environ.get(f"VAE_TRAINER_{name}", "")
    steps, _, ranks = spec.partition("@")
    if not spec or (ranks and os.environ.get("RANK", "0") not in ranks.split(",")):
        return set()
    return {int(s) for s in steps.split(",") if s}


NAN_LOSS, NAN_RECON = steps_from_env("INJECT_NAN"), steps_from_env("INJECT_NAN_RECON")
KILL_AT, SIGTERM_AT = steps_from_env("KILL_AT"), steps_from_env("SIGTERM_AT")


def flag(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else ""


def first_time(fault: str) -> bool:
    """True once per run directory and fault: a restarted worker must not fault again. Not by
    TORCHELASTIC_RESTART_COUNT: on two nodes the ranks can move between agents whose counts differ."""
    marker = os.path.join(flag("--output_dir"), flag("--run_name"), f".fault_{fault}_rank{os.environ.get('RANK', '0')}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False
current_step = [None]  # the step train_step is running, None outside it

train_step = vae_trainer.Trainer.train_step


def faulty_train_step(self, *args):
    if self.step in KILL_AT and first_time(f"kill{self.step}"):
        os.kill(os.getpid(), signal.SIGKILL)
    if self.step in SIGTERM_AT and first_time(f"sigterm{self.step}"):
        os.kill(os.getpid(), signal.SIGTERM)
    current_step[0] = self.step
    try:
        train_step(self, *args)
    finally:
        current_step[0] = None


training_forward = train_state.TrainingForward.forward


def faulty_training_forward(self, *args, **kwargs):
    recon, *rest = training_forward(self, *args, **kwargs)
    if current_step[0] in NAN_RECON:
        recon = recon * float("nan")
    return recon, *rest


objective_forward = objective.VAEObjective.forward


def faulty_objective_forward(self, *args, **kwargs):
    loss, logs = objective_forward(self, *args, **kwargs)
    if current_step[0] in NAN_LOSS:
        loss = loss * float("nan")
    return loss, logs


vae_trainer.Trainer.train_step = faulty_train_step
train_state.TrainingForward.forward = faulty_training_forward
objective.VAEObjective.forward = faulty_objective_forward

if __name__ == "__main__":
    sys.exit(vae_trainer.main(give_back_signals=False))
