"""vae_trainer.py whose in-loop evaluations report scripted values of one metric, so that which step is best is known
whatever this machine computes, and keep the weights each evaluation measured (the best-checkpoint tests); the
production code has no hook for it. In-process: monkeypatch evaluate.Validator.run with `scripted(key, values)`'s
function; as a command (plain python or under torchrun), VAE_TRAINER_EVAL_SCRIPT='eval_ema/psnr:10,12,11' scripts
it and VAE_TRAINER_EVAL_WEIGHTS names a folder that rank 0 fills with weights_<n>.pt, {"vae", "ema"} of the n-th
evaluation."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import evaluate  # noqa: E402
import vae_trainer  # noqa: E402


REAL_RUN = evaluate.Validator.run  # (a second scripted run in a process wraps this one, not the first's)


def scripted(key: str, values: list[float], folder: str | None = None) -> tuple:
    """(a Validator.run whose n-th evaluation in this process reports values[n] as `key`, its other results real; the
    list that receives, per evaluation, the whole weights and EMA it measured, also written to `folder`)."""
    run, measured = REAL_RUN, []

    def scripted_run(self, vae, ema_state, autocast):
        results, grids = run(self, vae, ema_state, autocast)
        results[key] = values[len(measured)]
        weights = {"vae": {k: v.detach().clone().cpu() for k, v in vae.state_dict().items()},
                   "ema": None if ema_state is None else {k: v.detach().clone().cpu() for k, v in ema_state.items()}}
        if folder and self.rank == 0:
            torch.save(weights, os.path.join(folder, f"weights_{len(measured)}.pt"))
        measured.append(weights)
        return results, grids

    return scripted_run, measured


if __name__ == "__main__":
    key, _, values = os.environ["VAE_TRAINER_EVAL_SCRIPT"].partition(":")
    evaluate.Validator.run = scripted(key, [float(v) for v in values.split(",")],
                                      os.environ.get("VAE_TRAINER_EVAL_WEIGHTS"))[0]
    sys.exit(vae_trainer.main(give_back_signals=False))
