"""The CLI's contract with a user: help, config resolution, one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from helpers import assert_one_line_error, run_cli, start_coordinator

from isthmus.deploy.config.job import ConfigError, load_config

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("command", [[], ["local"], ["coordinator"], ["config"]])
def test_help_says_what_it_does_and_lists_options_with_defaults(command):
    result = run_cli(*command, "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "usage: isthmus" in text
    if command == ["local"]:
        assert "emulated long-haul links" in text
        for flag, default in [
            ("--sites", "default 2"),
            ("--ranks-per-site", "default 2"),
            ("--steps", "default 20"),
            ("--run-dir", "default: a temporary folder"),
            ("--set", "override any config key"),
        ]:
            assert flag in text and default in text
    if command == ["coordinator"]:
        assert "--listen" in text and "default: cluster.coordinators.SITE" in text


def test_config_prints_every_key_with_its_doc():
    result = run_cli("config", "--set", "train.lr=0.01", "--steps", "7", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "lr = 0.01  # Peak learning rate" in result.stdout
    assert "steps = 7  # Optimizer steps to run." in result.stdout
    assert "[wan]" in result.stdout and "distance_km = 1000.0" in result.stdout


def test_precedence_file_then_set_then_flags(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[job]\nsteps = 5\nseed = 3\n[train]\nlr = 0.5\n")
    config = load_config(path, ["job.steps=6", "train.lr=0.25"], {"job.steps": 7})
    assert (config.job.steps, config.job.seed, config.train.lr) == (7, 3, 0.25)


def test_each_preset_trains_with_its_own_defaults_unless_the_job_says(tmp_path):
    from isthmus.intra.model_config import PRESET_TRAINING, PRESETS

    assert set(PRESET_TRAINING) == set(PRESETS)
    for name, want in PRESET_TRAINING.items():
        t = load_config(None, [f"model.preset={name}"]).train
        got = (t.lr, t.lr_reference_dp, t.warmup_steps, t.batch_size, t.seq_len)
        assert got == (want.lr, want.reference_dp, want.warmup_steps, want.batch_size,
                       want.seq_len), name  # fmt: skip
    # A 1b job does not take the CPU presets' 3e-3 (issue 16: it trained worse).
    assert load_config(None, ["model.preset=1b"]).train.lr == 1.5e-4
    # The GPU MoE presets carry their own sweep's rate, not their dense twin's
    # (docs/benchmarks/training-quality.md, "Learning rate of the MoE presets").
    assert load_config(None, ["model.preset=moe-125m"]).train.lr == 3e-4
    assert load_config(None, ["model.preset=moe-350m"]).train.warmup_steps == 15
    # What the job names wins, from --set and from a file, key by key.
    t = load_config(None, ["model.preset=1b", "train.lr=0.001", "train.seq_len=512"]).train
    assert (t.lr, t.seq_len, t.batch_size) == (0.001, 512, 8)
    path = tmp_path / "job.toml"
    path.write_text('[model]\npreset = "125m"\n[train]\nwarmup_steps = 7\n')
    t = load_config(path).train
    assert (t.warmup_steps, t.lr, t.seq_len) == (7, 6e-4, 2048)
    # The resolved config a launcher writes for its ranks reads back the same.

    config = load_config(None, ["model.preset=125m"])
    written = tmp_path / "resolved.toml"
    written.write_text(config.to_toml())
    assert load_config(written).train == config.train


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--set", "model.dimm=3"], ["unknown config key 'model.dimm'", "n_heads"]),
        (["--set", "nosuch.key=3"], ["unknown config section 'nosuch'"]),
        (
            ["--ranks-per-site", "3", "--set", "topology.tp=2"],
            ["does not divide the ranks", "pp*cp*tp"],
        ),
        (["--set", "train.lr=fast"], ["train.lr must be float"]),
        (["--set", "sync.codec=lz4"], ["sync.codec"]),
        (["--set", "model.preset=huge"], ["unknown model preset 'huge'", "tiny"]),
        (["--set", "model.n_heads=5"], ["dim=192 must be divisible by n_heads=5"]),
        (["--config", "/nonexistent/job.toml"], ["config file not found"]),
        (["--set", "parallel.compile=maybe"], ["parallel.compile must be auto, true or false"]),
        (["--set", "topology.device=cuda"], ["topology.device = cuda needs 4 GPUs, found 0"]),
        (
            ["--set", "topology.device=cuda", "--set", "run.share_gpus=true"],
            ["topology.device = cuda needs 2 GPUs, found 0"],
        ),
        (["--slow", "site7=2"], ["--slow site7=2: no site 'site7' in this job (site0, site1)"]),
        (["--slow", "site1=0.5@3"], ["want SITE=FACTOR[@STEP] with FACTOR >= 1"]),
        (["--slow", "site1=2@soon"], ["want SITE=FACTOR[@STEP]"]),
    ],
)
def test_bad_input_is_one_line_without_traceback(args, needles, tmp_path):
    result = run_cli("local", "--run-dir", str(tmp_path / "run"), *args, timeout=60)
    assert_one_line_error(result, *needles)
    assert result.returncode == 2
    # Nothing was started: no run files written for a config that never validated.
    assert not (tmp_path / "run" / "sites").exists()


@pytest.mark.parametrize(
    ("sizes", "gpus", "share", "firsts"),
    [
        ([2, 2], 4, False, [0, 2]),
        ([2, 2], 4, True, [0, 2]),  # enough GPUs: sharing changes nothing
        ([1, 1], 1, True, [0, 0]),  # one GPU, two one-rank sites
        ([2, 2], 2, True, [0, 0]),
        ([1, 1, 1], 2, True, [0, 1, 0]),
        ([2, 1], 2, True, [0, 0]),  # a site never straddles the last GPU
    ],
)
def test_sites_take_turns_on_the_gpus_only_with_share_gpus(sizes, gpus, share, firsts):
    from isthmus.deploy.launch.local import first_gpus

    assert first_gpus(sizes, gpus, share) == firsts


@pytest.mark.parametrize(
    ("device", "have", "needed", "needle"),
    [
        ("cuda", 1, 4, "topology.device = cuda needs 4 GPUs, found 1"),
        ("cuda", 4, 4, None),
        ("cpu", 0, 4, None),
        ("auto", 0, 4, None),  # no GPU: the CPU
        ("auto", 4, 4, None),
        # One GPU for four ranks: `auto` would start ranks 1-3 on GPUs that are not there.
        ("auto", 1, 4, "auto chose cuda, but this host has 1 GPU(s) for 4 ranks"),
    ],
)
def test_a_host_with_too_few_gpus_is_refused_naming_the_ways_out(device, have, needed, needle):
    from isthmus.deploy.launch.local import gpu_shortage

    problem = gpu_shortage(device, have, needed)
    if needle is None:
        assert problem is None
    else:
        assert needle in problem
        if device == "auto":
            assert "topology.device=cpu" in problem and "run.share_gpus=true" in problem


def test_compile_is_on_with_cuda_off_on_cpu_and_an_explicit_setting_wins(tmp_path):
    auto = load_config()
    assert auto.parallel.compile == "auto"
    assert auto.parallel_config(cuda=True).compile is True
    assert auto.parallel_config(cuda=False).compile is False
    off = load_config(overrides=["parallel.compile=false"])
    assert off.parallel_config(cuda=True).compile is False
    # A TOML boolean and the ways --set may spell it reach one value, so two sites
    # that say the same thing derive the same job fingerprint.
    path = tmp_path / "job.toml"
    path.write_text("[parallel]\ncompile = true\nmixed_precision = false\n")
    from_file = load_config(path)
    assert from_file.parallel_config(cuda=False).compile is True
    assert from_file.parallel_config(cuda=True).mixed_precision is False
    for spelling in ("true", "True", "yes"):
        from_set = load_config(
            overrides=[f"parallel.compile={spelling}", "parallel.mixed_precision=False"]
        )
        assert from_set.fingerprint() == from_file.fingerprint()
    assert from_file.fingerprint()["parallel.compile"] == "true"
    # "auto" is compared as written: what it resolves to depends on each site's device,
    # as topology.device = "auto" does.
    assert auto.fingerprint()["parallel.compile"] == "auto"
    assert auto.fingerprint() != from_file.fingerprint()


def test_unknown_key_in_a_toml_file_names_the_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[train]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'train.learning_rate'.*job.toml"):
        load_config(path)


def test_site_with_a_different_fingerprint_is_refused(tmp_path):
    """Two `isthmus coordinator` processes whose configs differ in the model size."""
    first, address = start_coordinator(
        "--site", "site0", "--peer", "site1=127.0.0.1:1", "--insecure"
    )
    try:
        started = time.monotonic()
        second = run_cli(
            "coordinator",
            "--site",
            "site1",
            "--peer",
            f"site0={address}",
            "--set",
            "model.dim=384",
            "--insecure",
            timeout=60,
        )
        assert time.monotonic() - started < 30
        # --insecure, so no token: the answer names the key; site0's values stay there.
        assert_one_line_error(second, "fingerprint differs", "model.dim")
        assert "=192" not in second.stderr and "192 vs" not in second.stderr
        assert second.returncode == 1
    finally:
        first.terminate()
        first.wait(10)
    assert first.returncode is not None


def test_sites_with_different_layouts_are_refused_naming_the_keys_and_values():
    first, address = start_coordinator("--site", "site0", "--peer", "site1=127.0.0.1:1")
    try:
        second = run_cli(
            "coordinator",
            *("--site", "site1", "--peer", f"site0={address}"),
            *("--set", "topology.ranks_per_site=4", "--set", "topology.tp=2"),
            timeout=60,
        )
        # Both hold the user's job token (deploy/security/token.py), so the caller is one of
        # the job's and the answer names the values too; the refusing site logs them.
        assert_one_line_error(second, "topology.ranks_per_site=2 vs 4; topology.tp=1 vs 2")
    finally:
        first.terminate()
        _, log = first.communicate(timeout=10)
    assert "topology.ranks_per_site=2 vs 4; topology.tp=1 vs 2" in log


def test_coordinator_rejects_a_site_outside_the_job():
    result = run_cli("coordinator", "--site", "site9", timeout=60)
    assert_one_line_error(result, "--site 'site9' is not one of")


def test_module_entry_point_matches_console_script():
    result = subprocess.run(
        ["isthmus", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:  # console script missing: the install step is broken
        pytest.fail(f"`isthmus` console script not installed: {result.stderr}")
    assert result.stdout == run_cli("--help").stdout


def test_the_cli_resolves_and_checks_a_job_without_importing_torch():
    # torch costs a launcher seconds of start-up on a small machine (its ranks pay it
    # anyway): the config, the codec spec, the model and the layout are checked first.
    code = (
        "import sys\n"
        "from isthmus.deploy import cli\n"
        "from isthmus.deploy.config.job import load_config\n"
        "code = cli.main(['config', '--set', 'sync.codec=int8+zstd:1', '--set', "
        "'model.preset=small', '--ranks-per-site', '2'])\n"
        "assert code == 0, code\n"
        "cfg = load_config(None, ['topology.tp=2', 'sync.codec=bf16+shuffle'])\n"
        "assert cfg.chunk_bytes > 0 and cfg.resolved_model().n_layers == 4\n"
        "# A job that `local` refuses is refused before the corpus (and torch) loads.\n"
        "assert cli.main(['local', '--set', 'model.dimm=3', '--slow', 'site1=2']) == 2\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout[-500:]


def test_offload_is_part_of_the_fingerprint_and_a_bad_value_is_refused():
    assert load_config(None, []).fingerprint()["parallel.offload"] == "False"
    on = load_config(None, ["parallel.offload=true"])
    assert on.fingerprint()["parallel.offload"] == "True"
    assert on.parallel_config(cuda=True).offload is True
    with pytest.raises(ConfigError, match="parallel.offload"):
        load_config(None, ["parallel.offload=sometimes"])


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["topology.cp=2", "train.seq_len=30"], "seq_len=30 divisible by 2*cp=4"),
        (["topology.cp=4", "topology.ranks_per_site=6"], "pp*cp*tp=1*4*1=4"),
        (["topology.cp=0"], "topology.pp, topology.cp and topology.tp must be >= 1"),
        (["topology.ep=2"], "needs a mixture of experts whose n_experts is a multiple"),
        (["topology.ep=4", "model.preset=moe-tiny"], "needs ep=4 to divide dp=2"),
        (["topology.ep=0", "model.preset=moe-tiny"], "expert_parallel must be an integer >= 1"),
    ],
)
def test_a_cp_or_ep_layout_that_does_not_fit_is_refused_naming_the_numbers(sets, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, sets)
    assert load_config(None, ["topology.cp=2", "train.seq_len=32"]).site_layout().cp == 2
    assert load_config(None, ["topology.cp=2"]).fingerprint()["topology.cp"] == "2"
    moe = load_config(None, ["topology.ep=2", "model.preset=moe-tiny"])
    assert moe.fingerprint()["topology.ep"] == "2"
    assert moe.parallel_config(cuda=False).expert_parallel == 2


def test_sites_of_different_sizes_are_one_list_and_part_of_the_fingerprint(tmp_path):
    cfg = load_config(None, ["topology.ranks_per_site=[4, 2]"])
    assert cfg.site_ranks == [4, 2] and cfg.ranks_of("site1") == 2
    assert cfg.topology.site_dp() == [4, 2] and cfg.site_layout("site1").dp == 2
    assert cfg.fingerprint()["topology.ranks_per_site"] == "[4, 2]"
    swapped = load_config(None, [], flags={"topology.ranks_per_site": "2,4"})
    assert swapped.fingerprint()["topology.ranks_per_site"] == "[2, 4]"
    # One size for all is one number, however it is spelled.
    same = load_config(None, ["topology.ranks_per_site=[2, 2]"])
    assert same.topology.ranks_per_site == 2
    assert same.fingerprint() == load_config(None, []).fingerprint()
    toml = tmp_path / "job.toml"
    toml.write_text("[topology]\nsites = 3\nranks_per_site = [2, 1, 4]\n")
    assert load_config(toml).site_ranks == [2, 1, 4]


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["topology.ranks_per_site=[4, 2, 2]"], "names 3 site sizes [4, 2, 2] for topology.sites=2"),
        (["topology.ranks_per_site=[4, 0]"], "must be >= 1"),
        (["topology.ranks_per_site=[4, 3]", "topology.tp=2"], "ranks_per_site=3 is not divisible"),
        (["topology.ranks_per_site=[4, 2]", "topology.ep=2", "model.preset=moe-tiny"],
         "topology.ep=2 needs sites of one size"),
        (["topology.ranks_per_site=[4, two]"], "an integer or a list of them"),
    ],
)  # fmt: skip
def test_site_sizes_that_cannot_work_are_refused_naming_the_numbers(sets, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, sets)


def test_a_bad_ranks_per_site_flag_is_a_one_line_error():
    result = run_cli("local", "--ranks-per-site", "4,x", "--steps", "1", timeout=60)
    assert_one_line_error(result, "topology.ranks_per_site must be an integer or a list")


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["train.accumulate=[2, 1, 1]"], "train.accumulate names 3 values [2, 1, 1] for topology.sites=2"),
        (["train.accumulate=0"], "train.accumulate must be >= 1"),
        (["train.accumulate=[2, 1]", "topology.pp=2"], "needs topology.pp=1 and parallel.offload=false"),
        (["train.accumulate=2", "parallel.offload=true"], "needs topology.pp=1"),
        (["train.balance_every=-1"], "train.balance_every must be >= 0"),
        (["train.balance_every=5", "sync.mode=diloco"], "train.balance_every=5 needs sync.mode=step"),
        (["train.balance_every=5", "topology.pp=2"], "needs sync.mode=step, topology.pp=1"),
        (["train.batch_schedule=cosine"], "train.batch_schedule must be fixed, ramp or noise, got 'cosine'"),
        (["train.batch_schedule=ramp", "train.accumulate=4"], "needs train.batch_ramp_steps >= 1, got 0"),
        (["train.batch_schedule=ramp", "train.batch_ramp_steps=5"], "train.batch_start=0 must lie in [4, 4) micro-batches"),
        (["train.batch_schedule=ramp", "train.batch_ramp_steps=5", "train.accumulate=4", "train.batch_start=1"], "train.batch_start=1 must lie in [4, 16)"),
        (["train.batch_schedule=noise", "train.accumulate=4"], "needs two or more sites and train.balance_every >= 1"),
        (["train.batch_schedule=ramp", "train.batch_ramp_steps=5", "train.accumulate=4", "sync.mode=diloco"], "train.batch_schedule=ramp needs sync.mode=step"),
    ],
)  # fmt: skip
def test_micro_batches_per_site_that_cannot_work_are_refused(sets, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, sets)
    cfg = load_config(None, ["train.accumulate=[2, 1]", "topology.ranks_per_site=[1, 2]"])
    assert cfg.site_units() == [2, 2] and cfg.fingerprint()["train.accumulate"] == "[2, 1]"
    assert load_config(None, ["train.accumulate=[3, 3]"]).train.accumulate == 3


# -- absurd sizes (issue 33, row 13) --------------------------------------------------


@pytest.mark.parametrize(
    ("command", "flags", "needle"),
    [
        # Issue 33, row 13: 100,000 ranks launched for 90 s until killed.
        ("local", ["--ranks-per-site", "100000"], "200000 CPU ranks on a host of"),
        ("site", ["--site", "site0", "--ranks-per-site", "100000"], "100000 CPU ranks on a host"),
        # --oversubscribe lets more ranks than cores start, not more than memory holds.
        ("local", ["--ranks-per-site", "100000", "--oversubscribe"], "of memory for 200000 ranks"),
        # Far beyond any host's memory (TiBs), so the test holds on a big machine too.
        ("local", ["--set", "train.batch_size=10000000"], "of logits a rank"),
        ("local", ["--set", "train.seq_len=100000000"], "train.seq_len=100000000"),
        ("local", ["--set", "model.dim=60000"], "of parameters, gradients and AdamW state a site"),
    ],
)
def test_absurd_sizes_are_refused_in_one_line_before_anything_starts(
    tmp_path, command, flags, needle
):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    cpu = ("--set", "topology.device=cpu")  # a GPU host would count GPUs instead
    result = run_cli(command, *flags, *cpu, "--steps", "1", "--run-dir", str(run_dir), timeout=60)
    assert_one_line_error(result, needle)
    assert result.returncode == 2  # a user's error
    assert not run_dir.exists()  # nothing made
    # Refused before the corpus is read or a process starts (the CLI's own start-up is
    # most of it: ~2 s on a 2-core machine).
    assert time.monotonic() - started < 30


def test_oversubscribe_is_a_flag_of_local_and_site():
    from isthmus.deploy.cli import build_parser
    from isthmus.deploy.commands.arguments import config_from_args

    parser = build_parser()
    for argv in (["local"], ["site", "--site", "site0"]):
        assert config_from_args(parser.parse_args(argv)).run.oversubscribe is False
        flagged = config_from_args(parser.parse_args([*argv, "--oversubscribe"]))
        assert flagged.run.oversubscribe is True


@pytest.mark.parametrize(
    ("cores", "site_ranks", "sets", "refused"),
    [
        (2, [2, 2], [], False),  # the default job on the 2-core CI machine
        (1, [4, 4], [], False),  # the floor: 8 ranks on any host (the e2e tests' largest)
        (1, [4, 5], [], True),
        (2, [9], [], True),  # one site (isthmus site) of 9 on 2 cores
        (4, [8, 8], [], False),  # 4 a core
        (4, [8, 9], [], True),
        (4, [8, 9], ["run.oversubscribe=true"], False),
    ],
)
def test_cpu_ranks_beyond_four_a_core_need_oversubscribe(cores, site_ranks, sets, refused):
    from isthmus.deploy.config.host_check import HostFacts, host_problem

    sizes = f"topology.ranks_per_site={site_ranks}"
    config = load_config(None, [sizes, f"topology.sites={len(site_ranks)}", *sets])
    host = HostFacts(cores=cores, memory_bytes=64 << 30)
    problem = host_problem(config, host, site_ranks, cuda=False)
    assert (problem is not None) == refused, problem
    if refused:
        assert f"{sum(site_ranks)} CPU ranks on a host of {cores} cores" in problem
        assert f"max(8, 4 x cores) = {max(8, 4 * cores)}" in problem
        assert "--oversubscribe" in problem


def test_memory_lower_bounds_refuse_only_what_cannot_fit():
    """Each bound is a floor (16 bytes a parameter, one micro-batch's logits, 256 MiB a
    process), so a refusal is never a guess; the presets' own jobs pass."""
    from isthmus.deploy.config.host_check import HostFacts, host_problem

    small_host = HostFacts(cores=2, memory_bytes=4 << 30)
    assert host_problem(load_config(), small_host, [2, 2], cuda=False) is None
    big = load_config(None, ["model.preset=1b", "train.seq_len=2048", "topology.ranks_per_site=8"])
    # An 8-GPU site of 80 GiB GPUs on a host of 1 TiB: the README's 1b recipe fits.
    gpu_host = HostFacts(cores=64, memory_bytes=1 << 40, gpus=8, gpu_memory_bytes=80 << 30)
    assert host_problem(big, gpu_host, [8], cuda=True) is None
    # The same model's state (~16 GiB) on one 8 GiB GPU does not.
    one = load_config(None, ["model.preset=1b", "topology.ranks_per_site=1"])
    small_gpu = HostFacts(cores=8, memory_bytes=64 << 30, gpus=1, gpu_memory_bytes=8 << 30)
    assert "each GPU needs at least" in host_problem(one, small_gpu, [1], cuda=True)
    # ... unless it is offloaded to a host that holds it.
    offload = load_config(
        None, ["model.preset=1b", "topology.ranks_per_site=1", "parallel.offload=true"]
    )
    assert host_problem(offload, small_gpu, [1], cuda=True) is None
    typo = load_config(None, ["train.batch_size=80000"])  # 8000 meant
    assert "of logits a rank" in host_problem(typo, small_host, [2, 2], cuda=False)


def test_the_default_job_fits_this_host():
    from isthmus.deploy.config.host_check import HostFacts, host_problem

    config = load_config()
    assert host_problem(config, HostFacts.here(cuda=False), config.site_ranks, cuda=False) is None
