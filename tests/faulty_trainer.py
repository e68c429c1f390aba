"""vae_trainer.py with faults injected for the fault-tolerance tests; the production code has no hooks for them.
Run it like vae_trainer.py (plain python or under torchrun), or in a test's process through
conftest.faults_in_process (all but the SIGKILL). Each variable names steps, optionally ranks:
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

import common  # noqa: E402
import objective  # noqa: E402
import vae_trainer  # noqa: E402
import train_state  # noqa: E402


def steps_from_env(name: str) -> set[int]:
    spec = os.environ.get(f"VAE_TRAINER_{name}", "")
    steps, _, ranks = spec.partition("@")
    if not spec or (ranks and os.environ.get("RANK", "0") not in ranks.split(",")):
        return set()
    return {int(s) for s in steps.split(",") if s}


def first_time(run_dir: str, fault: str) -> bool:
    """True once per run directory and fault: a restarted worker must not fault again. Not by
    TORCHELASTIC_RESTART_COUNT: on two nodes the ranks can move between agents whose counts differ."""
    marker = os.path.join(run_dir, f".fault_{fault}_rank{os.environ.get('RANK', '0')}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def install(patch=setattr) -> None:
    """Wraps the trainer's step, the training forward and the objective with the faults the environment names now.
    The command: at its start. A test's in-process runs: conftest.faults_in_process (patch: monkeypatch.setattr, so
    that the wrappers go when the test ends)."""
    nan_loss, nan_recon = steps_from_env("INJECT_NAN"), steps_from_env("INJECT_NAN_RECON")
    kill_at, sigterm_at = steps_from_env("KILL_AT"), steps_from_env("SIGTERM_AT")
    train_step = vae_trainer.Trainer.train_step
    training_forward = train_state.TrainingForward.forward
    objective_forward = objective.VAEObjective.forward
    current_step = [None]  # the step train_step is running, None outside it

    def faulty_train_step(self, *args):
        run_dir = os.path.dirname(self.ckpt_dir)
        if self.step in kill_at and first_time(run_dir, f"kill{self.step}"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.step in sigterm_at and first_time(run_dir, f"sigterm{self.step}"):
            # only to the run's stop flag: SIGTERM's default would end the process (a test's: pytest)
            assert isinstance(getattr(signal.getsignal(signal.SIGTERM), "__self__", None), common.StopFlag), \
                "no run's stop flag takes SIGTERM here (train_step called outside Trainer.train?)"
            os.kill(os.getpid(), signal.SIGTERM)
        current_step[0] = self.step
        try:
            train_step(self, *args)
        finally:
            current_step[0] = None

    def faulty_training_forward(self, *args, **kwargs):
        recon, *rest = training_forward(self, *args, **kwargs)
        if current_step[0] in nan_recon:
            recon = recon * float("nan")
        return recon, *rest

    def faulty_objective_forward(self, *args, **kwargs):
        loss, logs = objective_forward(self, *args, **kwargs)
        if current_step[0] in nan_loss:
            loss = loss * float("nan")
        return loss, logs

    patch(vae_trainer.Trainer, "train_step", faulty_train_step)
    patch(train_state.TrainingForward, "forward", faulty_training_forward)
    patch(objective.VAEObjective, "forward", faulty_objective_forward)


if __name__ == "__main__":
    install()
    sys.exit(vae_trainer.main(give_back_signals=False))
