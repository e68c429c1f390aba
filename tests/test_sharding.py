"""--sharding fsdp|hsdp (sharding.py): the same math as DDP, state that falls as 1/N, checkpoints that reshard onto
any world size and either sharding, written atomically, and the one-line refusals. Real torchrun (gloo) on the CPU
where only processes show it; the plumbing in-process."""
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import PLUMBING, ROOT, TINY, cli_env, cut_after, run_cli, run_in_process
from test_elastic import step_images

import checkpoint
import sharding
from common import ConfigError, DistInfo


def sharded_args(url, out, run, steps, *extra):
    """Checkpoints every step, all kept; the pixel losses (conftest.PLUMBING: LPIPS is a frozen network outside the
    sharded VAE, a loss on its reconstruction like the others, and half of a step's time here; test_best's fsdp run
    trains it), the GAN (the PatchGAN
    critic: the critic is not sharded, and the VGG16 one doubles a step's time) with LeCam from step 1, EMA, 2
    micro-batches per step; NCHW (the sharded VAE's layout: on a CPU the DDP run would otherwise be channels_last,
    whose noise draws differ)."""
    return ["--dataset_url", url, "--output_dir", str(out), "--run_name", run, "--max_steps", str(steps),
            "--save_every_n_steps", "1", "--log_every_n_steps", "1", "--evaluate_every_n_steps", "0",
            "--keep_last_k", "20", *PLUMBING, "--do_ganloss", "--disc_start", "1", "--lecam_weight", "0.1",
            "--discriminator", "patchgan", "--ema_decay", "0.9", "--num_threads", "1", "--channels_last", "false",
            "--memory_check", "false", *extra]


def logged(run_dir) -> dict[int, dict]:
    """{step: its logged losses and VAE gradient norm}."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("loss/") or k == "grad_norm/vae"} for r in rows}


def worst_relative(a: dict, b: dict) -> float:
    """The largest relative difference of the values two logs share."""
    return max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-6) for k in a if k in b)


@pytest.fixture(scope="session")  # not per module: xdist interleaves modules, which built it twice (2 x 2 minutes)
def runs(shard_url, tmp_path_factory):
    """5 steps of 2 ranks x --grad_accum 2 three ways: ddp, fsdp (recorded: tests/recording_trainer.py), and ddp on
    1 rank x --grad_accum 4 (the same micro-batches, issue 34: it differs from the 2-rank run only in the order of
    the fp32 sums, the yardstick of "float rounding"; in this process: one rank is the same computation without
    torchrun)."""
    import vae_trainer
    out = tmp_path_factory.mktemp("sharded")
    (out / "record").mkdir()
    env = cli_env(VAE_TRAINER_RECORD=str(out / "record"))
    for run, extra in (("ddp", ["--sharding", "ddp"]), ("fsdp", ["--sharding", "fsdp"])):
        script = "tests/recording_trainer.py" if run == "fsdp" else "vae_trainer.py"
        result = run_cli(script, sharded_args(shard_url, out, run, 5, "--grad_accum", "2", *extra), nproc=2,
                         env=env if run == "fsdp" else cli_env())
        assert result.returncode == 0, result.stderr[-3000:]
        if run == "fsdp":
            assert "sharding: fsdp, the trained state in 2 shards" in result.stdout, result.stdout[-2000:]
            assert "(sharded: each rank wrote its shards)" in result.stdout
    threads = torch.get_num_threads()
    try:  # (--num_threads 1 is set for the whole process: given back after)
        assert vae_trainer.main(sharded_args(shard_url, out, "one", 5, "--grad_accum", "4")) == 0
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.xdist_group("sharded_runs")  # shares the runs fixture: built once
@pytest.mark.process
@pytest.mark.timeout(600)
def test_fsdp_trains_as_ddp_does_to_float_rounding(runs):
    """The same 5 steps (GAN, LeCam, EMA, accumulation) under fsdp and ddp on 2 ranks. Step 1 starts from the same
    weights: its losses and the VAE's clipped gradient norm (over every rank's shards) equal DDP's to 1e-6. Later
    steps part by rounding only: the fsdp-vs-ddp difference of every logged loss stays within 3x the difference of
    two DDP runs that differ only in the order of their sums (2 ranks x 2 micro-batches against 1 x 4), and within
    1e-3 relative. (Adam turns any rounding of a near-zero gradient into a +-lr step, so the runs part a little
    more each step; an unreduced shard's gradient moves the losses by percents.) The sharded checkpoint's EMA is
    the average of its weights on every shard: ema_k = d ema_(k-1) + (1-d) w_k, d = min(0.9, (1+k)/(10+k))."""
    ddp, fsdp, one = (logged(runs / name) for name in ("ddp", "fsdp", "one"))
    assert sorted(ddp) == sorted(fsdp) == [1, 2, 3, 4, 5]
    assert worst_relative(fsdp[1], ddp[1]) <= 1e-6, (fsdp[1], ddp[1])  # clipping by a local norm: ~30 % off
    rounding = max(worst_relative(one[step], ddp[step]) for step in range(2, 6))
    ours = max(worst_relative({k: v for k, v in fsdp[step].items() if k.startswith("loss/")}, ddp[step])
               for step in range(2, 6))
    assert ours <= max(3 * rounding, 1e-6) and ours <= 1e-3, (ours, rounding)
    ckpts = [checkpoint.load_checkpoint(str(runs / "fsdp" / "checkpoints" / f"step_{k:08d}")) for k in (3, 4)]
    for name, ema in ckpts[1]["training"]["ema"].items():
        decay = min(0.9, (1 + 3) / (10 + 3))  # the EMA's update after step 4 is its update number 3 (from 0)
        expected = decay * ckpts[0]["training"]["ema"][name] + (1 - decay) * ckpts[1]["training"]["vae"][name]
        if ema.is_floating_point():
            assert torch.allclose(ema, expected, rtol=1e-5, atol=1e-7), name


@pytest.mark.xdist_group("sharded_runs")  # shares the runs fixture: built once
@pytest.mark.process
@pytest.mark.timeout(600)
def test_a_sharded_run_resumes_on_4_ranks_then_on_1_with_the_same_steps(runs, tmp_path, shard_url, capfd, monkeypatch,
                                                                       one_torch_thread):
    """The fsdp run stopped after step 3 (its own directory, cut back) continues on 4 ranks (the DCP checkpoint of 2
    ranks resharded onto 4: each reads only its shards) for step 4, then on 1 process (which reads it whole and
    writes a single file; this one) for step 5. Every step trains on the uninterrupted run's images, bitwise; step 4 computes
    what the uninterrupted run computed from the same checkpoint up to the order of the fp32 sums (1e-5, the bound
    of the elastic tests), and so does step 5 against a 2-rank fsdp run resumed from the same step-4 checkpoint."""
    cut = tmp_path / "cut"
    cut_after(runs / "fsdp", cut, 3)
    record = tmp_path / "record"
    record.mkdir()
    env = cli_env(VAE_TRAINER_RECORD=str(record))
    four = run_cli("tests/recording_trainer.py", sharded_args(shard_url, tmp_path, "cut", 4, "--grad_accum", "2",
                                                             "--sharding", "fsdp"), nproc=4, env=env)
    assert four.returncode == 0, four.stderr[-3000:]
    assert "resumed from" in four.stdout and "sharding: fsdp, the trained state in 4 shards" in four.stdout
    assert sorted(os.listdir(cut / "checkpoints" / "step_00000004")).count("rest.pt") == 1
    shutil.copytree(cut, tmp_path / "control")
    import recording_trainer
    import vae_trainer
    monkeypatch.setattr(vae_trainer.Trainer, "train_step", recording_trainer.recording_train_step)
    monkeypatch.setenv("VAE_TRAINER_RECORD", str(record))
    one = run_in_process(vae_trainer.main, sharded_args(shard_url, tmp_path, "cut", 5, "--grad_accum", "2",
                                                        "--sharding", "fsdp"), capfd)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "--sharding fsdp on one process shards nothing" in one.stdout, one.stdout[-2000:]
    assert os.path.isfile(cut / "checkpoints" / "step_00000005.pt")
    control = run_cli("vae_trainer.py", sharded_args(shard_url, tmp_path, "control", 5, "--grad_accum", "2",
                                                     "--sharding", "fsdp"), nproc=2)
    assert control.returncode == 0, control.stderr[-3000:]
    reference = step_images(runs / "record")
    assert step_images(record) == {k: reference[k] for k in (3, 4)}  # (the record's step: completed steps before)
    assert worst_relative(logged(cut)[4], logged(runs / "fsdp")[4]) <= 1e-5
    assert worst_relative(logged(cut)[5], logged(tmp_path / "control")[5]) <= 1e-5
    assert "warning" not in four.stderr + one.stderr, four.stderr + one.stderr


@pytest.mark.xdist_group("sharded_runs")  # shares the runs fixture: built once
@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_sharded_run_continues_under_ddp_on_one_process_with_the_same_steps(runs, tmp_path, shard_url, capfd,
                                                                              one_torch_thread):
    """The fsdp run stopped after step 3 continues on 1 process (this one) under --sharding ddp, its VAE channels_last there
    (a CPU's auto; the sharded run's was NCHW): steps 4 and 5 compute what the uninterrupted run computed up to
    rounding (1e-4: channels_last convolutions are other kernels, 1.6e-5 off in the gradient norm). Issue 48:
    AdamW's moments came back in the sharded run's layout, which fused AdamW walks in the parameter's memory order
    (step 5 7.4e-2 off), and the posterior noise followed the layout."""
    cut = tmp_path / "cut"
    cut_after(runs / "fsdp", cut, 3)
    import vae_trainer
    result = run_in_process(vae_trainer.main, sharded_args(shard_url, tmp_path, "cut", 5, "--grad_accum", "2",
                                                           "--sharding", "ddp", "--channels_last", "auto"), capfd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--sharding fsdp -> ddp" in result.stdout, result.stdout[-2000:]
    for step in (4, 5):
        assert worst_relative(logged(cut)[step], logged(runs / "fsdp")[step]) <= 1e-4, step


@pytest.mark.xdist_group("sharded_runs")  # shares the runs fixture: built once
@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_single_file_checkpoint_of_a_ddp_run_resumes_sharded(runs, tmp_path, shard_url):
    """The ddp run's step_3.pt (whole tensors, AdamW's state by integer id) continues under --sharding fsdp on 2
    ranks: each rank takes its shards of the weights, moments and EMA, and step 4 computes what the ddp run's
    step 4 computed from that file (losses and gradient norm to 1e-5)."""
    cut = tmp_path / "ddp"
    cut_after(runs / "ddp", cut, 3)
    result = run_cli("vae_trainer.py", sharded_args(shard_url, tmp_path, "ddp", 4, "--grad_accum", "2",
                                                    "--sharding", "fsdp"), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and os.path.isdir(cut / "checkpoints" / "step_00000004")
    assert worst_relative(logged(cut)[4], logged(runs / "ddp")[4]) <= 1e-5


@pytest.mark.process
@pytest.mark.timeout(300)
def test_each_rank_holds_a_1_over_n_share_of_the_trained_state(tmp_path):
    """tests/sharded_state.py on 2 ranks, the whole VAE trained and then a decoder-only fine-tune (one launch),
    after a real step: each rank's local parameters, gradients, AdamW moments and EMA are its share of the whole
    (they add up to it exactly, and none exceeds 1/N of it by more than FSDP's padding of each tensor's first
    dimension: one row per tensor); the decoder-only fine-tune's frozen encoder stays whole on every rank and is no
    DTensor."""
    n = 2  # (4 ranks: the same shares of 4, at two processes more; onto 4 ranks: the 4 -> 1 resume test's run)
    result = run_cli("tests/sharded_state.py", [str(tmp_path), "fsdp", "all,decoder"], nproc=n)
    assert result.returncode == 0, result.stderr[-3000:]
    for train_parts in ("all", "decoder"):
        ranks = [json.loads((tmp_path / train_parts / f"rank{r}.json").read_text()) for r in range(n)]
        whole = ranks[0]["whole_trained"]
        for part, factor in (("params", 1), ("grads", 1), ("optimizer", 2), ("ema", 1)):
            assert sum(r[part] for r in ranks) == factor * whole, (train_parts, part)
            # the padding: at most one row of each of the model's tensors (a bias: one element), well under 2 %
            assert all(r[part] <= factor * whole / n * 1.02 for r in ranks), (train_parts, part,
                                                                            [r[part] for r in ranks])
        frozen = {r["frozen"] for r in ranks}
        assert len(frozen) == 1 and all(r["frozen_dtensors"] == 0 for r in ranks)
        assert (frozen.pop() > 0) == (train_parts == "decoder")


def test_frozen_parameters_stay_whole_plain_tensors_outside_the_groups(tmp_path):
    """sharding.shard on a 1-rank gloo group, in this process: a frozen unit, a unit that mixes frozen and trained
    parameters, and a trained one: every frozen parameter stays the same plain tensor, whole, in no FSDP group (the
    groups' ignored_params; without them FSDP2 makes frozen parameters DTensors too), every trained one is a
    DTensor. (tests/sharded_state.py checks the same on 2 ranks in a process; this is its cheap guard.)"""
    import torch.distributed as dist
    import sharding
    from common import DistInfo
    from torch import nn
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.mixed, self.dec = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), \
                nn.Linear(4, 4)

        def forward(self, x):
            return self.dec(self.mixed(self.enc(x)))
    torch.manual_seed(0)
    model = Model()
    model.enc.requires_grad_(False)
    model.mixed[0].requires_grad_(False)
    frozen = {name: (p, p.detach().clone()) for name, p in model.named_parameters() if not p.requires_grad}
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = sharding.mesh_for("fsdp", DistInfo(rank=0, world_size=1))
        sharding.shard(model, [model.enc, model.mixed, model.dec], mesh)
        params = dict(model.named_parameters())
        for name, (before, value) in frozen.items():
            assert not sharding.is_dtensor(params[name]) and params[name] is before, name
            assert torch.equal(params[name], value)
        assert all(sharding.is_dtensor(p) for name, p in params.items() if name not in frozen)
        assert set(params) - set(frozen) == {"mixed.1.weight", "mixed.1.bias", "dec.weight", "dec.bias"}
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# checkpoints: atomic, listed, read whole on one process
# --------------------------------------------------------------------------------------------
KILLED_SAVE = r"""
import os, sys, time, torch
sys.path.insert(0, {root!r})
import checkpoint, common
from common import DistInfo
ckpt_dir = sys.argv[1]

def state(step):
    weights = {{"w": torch.full((64, 8), float(step)), "b": torch.arange(8.0) * step}}
    return {{"format_version": 2, "training": {{"vae": weights, "ema": None, "optimizer": {{"state": {{}},
            "param_groups": []}}, "train_parts": "all"}}, "run": {{"step": step}}}}

checkpoint.write_checkpoint(ckpt_dir, 1, state(1), 3, DistInfo())
real = common.atomic_write
def stalled(path, write):  # the second save stops for good after DCP wrote its files, before rest.pt
    open(os.path.join(ckpt_dir, "..", "stalled"), "w").close()
    time.sleep(600)
common.atomic_write = stalled
checkpoint.write_checkpoint(ckpt_dir, 2, state(2), 3, DistInfo())
"""


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_kill_during_a_sharded_save_leaves_the_last_checkpoint_loadable(tmp_path):
    """A process SIGKILLed inside the save of step 2 (DCP's files written, rest.pt not yet): step 1's directory is
    still the run's latest checkpoint and loads; the half-written one is not listed, and the next save clears it."""
    ckpt_dir = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE.format(root=ROOT), str(ckpt_dir)], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not (tmp_path / "stalled").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert os.listdir(ckpt_dir / ".step_00000002.incomplete")  # DCP's files were there
    assert checkpoint.checkpoint_files(str(ckpt_dir)) == [str(ckpt_dir / "step_00000001")]
    path, state = checkpoint.load_latest_checkpoint(str(ckpt_dir))
    assert state["run"]["step"] == 1 and torch.equal(state["training"]["vae"]["b"], torch.arange(8.0))
    # a sharded checkpoint read for a resume holds all but its DCP parts, which it names
    rest = checkpoint.load_checkpoint(path, whole=False)
    assert "vae" not in rest["training"] and rest["training"]["dcp"] == ["optimizer", "vae"]
    state["run"]["step"] = 2
    checkpoint.write_checkpoint(str(ckpt_dir), 2, state, 3, DistInfo())
    assert sorted(os.listdir(ckpt_dir)) == ["latest", "step_00000001", "step_00000002"]


# --------------------------------------------------------------------------------------------
# refusals and notes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,named", [
    (["--compile"], "--compile"),
    (["--channels_last", "true"], "--channels_last true"),
    (["--loss_balance", "adaptive"], "--loss_balance adaptive"),
    (["--vf_weight", "0.1", "--vf_weights", "random"], "--vf_weight"),
])
def test_a_flag_that_does_not_compose_with_sharding_is_refused_in_one_line(flags, named, tmp_path):
    """Refused by the configuration's checks (before torchrun's workers build anything), naming both flags."""
    from run_setup import prepare_run
    with pytest.raises(ConfigError) as e:
        prepare_run(["--dataset_url", str(tmp_path / "x.tar"), "--output_dir", str(tmp_path), *TINY,
                     "--sharding", "fsdp", *flags])
    assert "--sharding fsdp does not compose with " + named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("layout", ["by_name", "by_id"])
def test_moments_saved_in_another_memory_format_continue_the_same_adamw(layout):
    """A run continued in another memory format (a sharded run's NCHW VAE under ddp on a CPU, channels_last; a ddp
    run's .pt with another --channels_last) gets moments laid out as they were saved. Fused AdamW walks a parameter,
    its gradient and its moments in memory order, so each moment must be laid out as its parameter or the update
    lands on other elements (issue 48: 7.4e-2 off in the loss one step later). The continued step equals, bitwise,
    the step from the same moments laid out as the parameters (converted here, by value)."""
    def conv():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 4, 3))

    def step(model, optimizer, seed):
        model.zero_grad()
        x = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(seed))
        model(x).square().mean().backward()
        optimizer.step()

    saved = conv()  # the run that wrote the checkpoint: NCHW, 2 steps
    saved_opt = torch.optim.AdamW(saved.parameters(), lr=1e-2, fused=True)
    for seed in (1, 2):
        step(saved, saved_opt, seed)
    state = sharding.optimizer_state(saved, saved_opt) if layout == "by_name" else saved_opt.state_dict()
    continued = []
    for convert in (False, True):
        model = conv().to(memory_format=torch.channels_last)  # the continuation: channels_last
        model.load_state_dict(saved.state_dict())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        sharding.load_optimizer(model, optimizer, copy.deepcopy(state))  # (torch's load keeps the tensors it is given)
        if convert:  # the reference: each moment's values, laid out as its parameter
            for p in model.parameters():
                for k, v in optimizer.state[p].items():
                    if v.dim() == 4:
                        optimizer.state[p][k] = v.contiguous(memory_format=torch.channels_last)
        step(model, optimizer, 3)
        continued.append(model)
    for (name, p), q in zip(continued[0].named_parameters(), continued[1].parameters()):
        assert torch.equal(p, q), name


def test_the_posterior_noise_is_the_same_in_either_memory_format():
    """The same seed draws the same noise per latent element whether the VAE runs channels_last (ddp on a CPU) or
    NCHW (fsdp, CUDA): a sharded run continued under ddp on a CPU trains on its numbers (randn_like follows the
    mean's strides, and drew another noise per element)."""
    import ae
    vae = ae.AutoEncoder(ae.AutoEncoderParams(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, posterior="learned"))
    mean = torch.randn(2, 4, 8, 8)
    logvar = torch.randn(2, 4, 8, 8)
    draws = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        torch.manual_seed(5)
        draws.append(vae.sample(mean.contiguous(memory_format=fmt), logvar.contiguous(memory_format=fmt)))
    assert torch.equal(*draws)


def test_the_start_says_which_sharding_and_what_it_holds_per_rank(monkeypatch):
    ddp = sharding.describe("ddp", 8, 1_220_000_000, ema=True)
    assert ddp == ["sharding: ddp, the trained state whole on each of 8 ranks (22.72 GiB each: weights, gradients, "
                   "AdamW, EMA); --sharding fsdp would hold 2.84 GiB per rank"]
    fsdp = sharding.describe("fsdp", 8, 1_220_000_000, ema=False)
    assert fsdp == ["sharding: fsdp, the trained state in 8 shards (2.27 GiB per rank of 18.18 GiB; ddp would hold "
                    "all of it on each)"]
    assert sharding.describe("fsdp", 1, 10, ema=True)[0].startswith("note: --sharding fsdp on one process")
    assert sharding.describe("fsdp", 2, 1_000_000, ema=True)[1].startswith("note: --sharding fsdp of 1.0M trained")
    assert sharding.describe("ddp", 1, 10, ema=True) == []
    # hsdp where it can replicate nothing: one process, or every rank on one node (torchrun's LOCAL_WORLD_SIZE)
    assert sharding.describe("hsdp", 1, 10, ema=True) == [
        "note: --sharding hsdp on one process shards nothing: it trains as ddp would"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    one_node = sharding.describe("hsdp", 2, 10**10, ema=True)
    assert one_node[1] == "note: --sharding hsdp on one node of 2 ranks replicates nothing: it trains as --sharding fsdp would"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert len(sharding.describe("hsdp", 2, 10**10, ema=True)) == 1  # two nodes: replicas, no note


def test_the_units_are_the_blocks_the_encoder_and_decoder_call():
    """FSDP gathers a unit in its forward's hooks: ae.py's levels and mid are containers, so the units are their
    ResnetBlocks and resampling convs (every one is called by Encoder/Decoder.forward); conv_in/out stay in the
    root's group."""
    from ae import AutoEncoder, AutoEncoderParams, Downsample, ResnetBlock, Upsample
    vae = AutoEncoder(AutoEncoderParams(ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4, use_attn=False,
                                        norm_groups=8))
    units = sharding.shard_units(vae)
    assert all(isinstance(u, (ResnetBlock, Downsample, Upsample)) for u in units)
    blocks = [m for m in vae.modules() if isinstance(m, (ResnetBlock, Downsample, Upsample))]
    assert len(units) == len(blocks)
    assert vae.encoder.conv_in not in units and vae.decoder.conv_out not in units


def test_a_single_file_checkpoint_of_an_earlier_release_still_names_itself_a_checkpoint(tmp_path):
    """Checkpoint listing: files and complete sharded directories by step, newest first; an incomplete directory
    (no rest.pt) is skipped."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"x": 1}, folder / "step_00000002.pt")
    (folder / "step_00000003").mkdir()  # incomplete: no rest.pt
    (folder / "step_00000001").mkdir()
    (folder / "step_00000001" / "rest.pt").write_bytes(b"")
    (folder / "step_00000001" / ".metadata").write_bytes(b"")
    assert checkpoint.checkpoint_files(str(folder)) == [str(folder / "step_00000002.pt"),
                                                        str(folder / "step_00000001")]
    assert checkpoint.is_checkpoint_name("step_00000003") and not checkpoint.is_checkpoint_name(".step_1.incomplete")
    assert DistInfo().is_main  # (the single-process info write_checkpoint takes for a sharded run's one process)


@pytest.mark.process
@pytest.mark.timeout(900)
def test_every_diffusers_class_trains_sharded_with_its_unsharded_gradients():
    """tests/sharded_families.py on 2 ranks: each class the registry trains, sharded into the units
    families.Family.shard_units names, and the native Wan family's video model (its explicit temporal cache calls each
    unit once per chunk), give every parameter its unsharded gradient (1e-5 of the largest). Refused in one line:
    LTX-Video's timestep-conditioned decoder, whose trained scalar FSDP2 cannot shard, and diffusers' Wan, whose
    time_convs lose their gradients sharded (seen here: the mutant is the refusal removed)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_families import TINY as classes
    result = run_cli("tests/sharded_families.py", [], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    ok = {line.split()[1] for line in lines if line.startswith("ok ")}
    refused = {line.split()[1].rstrip(":") for line in lines if line.startswith("refused ")}
    assert ok | refused == set(classes) | {"wan_ae.WanVideo"}, result.stdout  # (no "wrong" line)
    assert refused == {"AutoencoderKLLTXVideo", "AutoencoderKLWan"}, result.stdout
    assert all(int(line.split()[2]) >= 8 for line in lines if line.startswith("ok ")), result.stdout


def test_a_parameter_that_never_had_a_gradient_resumes_without_moments(tmp_path):
    """AdamW holds no moments for a parameter without a gradient yet (a video model's time_conv before its first clip
    step). A sharded checkpoint of such a run (DCP) and a DDP run's .pt of it both load into a fresh sharded
    optimizer: the parameter stays without moments, the others get theirs (one rank's mesh, in-process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    def build():
        torch.manual_seed(0)
        return Toy(), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)

    plain, make = build()
    optimizer = make(plain)
    plain(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    pt_state = optimizer.state_dict()  # integer ids, as a DDP run's .pt holds it
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        written, _ = build()
        sharding.shard(written, [written.used, written.unused], mesh)
        first = make(written)
        written(torch.ones(2, 4)).sum().backward()
        first.step()
        state = {"format_version": 2, "training": {"vae": written.state_dict(), "ema": None,
                                                   "optimizer": sharding.optimizer_state(written, first)}}
        sharding.save_dcp(state, str(tmp_path / "tmp"), str(tmp_path / "ckpt"), DistInfo())
        for source in ("dcp", "pt"):
            fresh, _ = build()
            sharding.shard(fresh, [fresh.used, fresh.unused], mesh)
            optimizer = make(fresh)
            if source == "dcp":
                loaded = sharding.load_sharded(str(tmp_path / "ckpt"), {
                    "vae": fresh.state_dict(), "optimizer": sharding.optimizer_state(fresh, optimizer)})["optimizer"]
            else:
                loaded = pt_state
            sharding.load_optimizer(fresh, optimizer, loaded)
            held = {name for name, p in fresh.named_parameters() if optimizer.state.get(p)}
            assert held == {"used.weight", "used.bias"}, (source, held)
            moments = optimizer.state[fresh.used.weight]["exp_avg"]
            assert torch.equal(sharding.whole(moments), first.state[written.used.weight]["exp_avg"].full_tensor())
    finally:
        dist.destroy_process_group()


def test_a_channels_last_ddp_checkpoint_continues_exactly_under_fsdp(tmp_path):
    """The real --sharding fsdp path of a ddp run's .pt (channels_last on a CPU): set_optimizer_state_dict shards
    each whole moment as it was saved, so its local shard keeps channels_last strides under an NCHW shard; loaded
    by sharding.load_optimizer, the next step equals the saving optimizer's (one rank's mesh, in-process; issue 48)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 3))

    grads = [[torch.randn(p.shape) for p in build().parameters()] for _ in range(2)]

    def step(module, optimizer, k):
        for p, g in zip(module.parameters(), grads[k]):
            p.grad = (distribute_tensor(g, p.device_mesh, p.placements) if hasattr(p, "device_mesh")
                      else torch.empty_like(p).copy_(g))
        optimizer.step()

    saving = build().to(memory_format=torch.channels_last)
    first = torch.optim.AdamW(saving.parameters(), lr=1e-2, fused=True)
    step(saving, first, 0)
    saved = copy.deepcopy(first.state_dict())  # integer ids, as a DDP run's .pt holds it
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        continuing = build()
        continuing.load_state_dict(saving.state_dict())
        sharding.shard(continuing, list(continuing), init_device_mesh("cpu", (1,), mesh_dim_names=("shard",)))
        second = torch.optim.AdamW(continuing.parameters(), lr=1e-2, fused=True)
        sharding.load_optimizer(continuing, second, saved)
        step(saving, first, 1)
        step(continuing, second, 1)
        for (name, a), b in zip(saving.named_parameters(), continuing.parameters()):
            assert torch.equal(a.detach(), b.full_tensor().detach()), name
    finally:
        dist.destroy_process_group()
