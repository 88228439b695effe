"""Every launcher and sweep in dry-run mode: the exact commands they would run."""

import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest
from absl import flags

from launch import common, local, sweep, tpu_pod
from sage_jax import config_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEPS = os.path.join(REPO, "configs", "sweeps")


def _run(argv, env=None):
  out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **(env or {})})
  assert out.returncode == 0, out.stderr
  return out.stdout


def test_local_dry_run():
  out = _run([sys.executable, "launch/local.py", "--config=configs/sage.py:demo",
              "--workdir=runs/demo", "--cpu_devices=8", "--override=grpo.group_size=4",
              "--dry_run"])
  argv = shlex.split(out)
  assert argv[:3] == ["env", "XLA_FLAGS=--xla_force_host_platform_device_count=8",
                      "JAX_PLATFORMS=cpu"]
  assert argv[4:] == ["-m", "sage_jax.train", "--config=configs/sage.py:demo",
                      "--workdir=runs/demo", "--config.grpo.group_size=4"]


def test_local_multi_process_dry_run():
  out = _run([sys.executable, "launch/local.py", "--num_processes=2", "--cpu_devices=2",
              "--port=4321", "--config=configs/sage.py:demo", "--workdir=runs/demo2",
              "--dry_run"])
  lines = [shlex.split(line) for line in out.strip().splitlines()]
  assert len(lines) == 2
  for i, argv in enumerate(lines):
    assert argv[:7] == ["env", "XLA_FLAGS=--xla_force_host_platform_device_count=2",
                        "JAX_PLATFORMS=cpu", "JAX_COORDINATOR_ADDRESS=127.0.0.1:4321",
                        "JAX_NUM_PROCESSES=2", f"JAX_PROCESS_ID={i}", sys.executable]
    assert argv[7:] == ["-m", "sage_jax.train", "--config=configs/sage.py:demo",
                        "--workdir=runs/demo2"]
  command = _run([sys.executable, "launch/local.py", "--num_processes=2", "--port=4321",
                  "--dry_run", "--", "python", "-m", "sage_jax.generate", "--prompt=hi"])
  assert command.splitlines()[1].endswith("JAX_PROCESS_ID=1 python -m sage_jax.generate "
                                          "--prompt=hi")


def test_local_processes_get_disjoint_shares_of_the_listed_gpus():
  """jax.distributed takes the processes' local devices to be disjoint: each process sees
  only its own contiguous share of --gpus (it drives every GPU it sees)."""
  base = [sys.executable, "launch/local.py", "--port=4321", "--config=configs/sage.py:demo",
          "--workdir=runs/demo2", "--dry_run"]
  lines = [shlex.split(line) for line in
           _run(base + ["--num_processes=2", "--gpus=0,1,2,3"]).strip().splitlines()]
  assert [argv[1:3] for argv in lines] == [
      ["CUDA_VISIBLE_DEVICES=0,1", "JAX_COORDINATOR_ADDRESS=127.0.0.1:4321"],
      ["CUDA_VISIBLE_DEVICES=2,3", "JAX_COORDINATOR_ADDRESS=127.0.0.1:4321"]]
  assert shlex.split(_run(base + ["--gpus=0,1,2,3"]))[:2] == ["env", "CUDA_VISIBLE_DEVICES=0,1,2,3"]
  assert local.gpu_shares("4,5,6,7,8,9", 3) == ["4,5", "6,7", "8,9"]
  assert local.gpu_shares(None, 2) is None
  assert _fails(base + ["--num_processes=2", "--gpus=0,1,2"]).endswith(
      "--gpus=0,1,2: 3 GPUs do not split evenly over --num_processes=2")


def test_local_processes_share_out_the_gpus_the_launcher_sees():
  """Without --gpus, N processes split the GPUs that CUDA_VISIBLE_DEVICES gives the launcher
  (a scheduler's allocation) instead of each driving them all; --gpus, or simulated CPU
  devices, take precedence; one process keeps what it is given."""
  base = [sys.executable, "launch/local.py", "--port=4321", "--config=configs/sage.py:demo",
          "--workdir=runs/demo2", "--dry_run"]
  allocated = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}

  def visible(argv, env=allocated):
    return [[a for a in shlex.split(line) if a.startswith("CUDA_VISIBLE_DEVICES=")]
            for line in _run(base + argv, env).strip().splitlines()]

  assert visible(["--num_processes=2"]) == [["CUDA_VISIBLE_DEVICES=4,5"],
                                            ["CUDA_VISIBLE_DEVICES=6,7"]]
  assert visible(["--num_processes=4"]) == [[f"CUDA_VISIBLE_DEVICES={g}"] for g in "4567"]
  assert visible(["--num_processes=2", "--gpus=6,7"]) == [["CUDA_VISIBLE_DEVICES=6"],
                                                          ["CUDA_VISIBLE_DEVICES=7"]]
  assert visible(["--num_processes=2", "--cpu_devices=2"]) == [[], []]
  assert visible([]) == [[]]
  assert _fails(base + ["--num_processes=3"], allocated).endswith(
      "CUDA_VISIBLE_DEVICES=4,5,6,7: 4 GPUs do not split evenly over --num_processes=3; "
      "list the ones to use with --gpus")


def test_every_entry_point_launches_with_its_own_flags():
  """Export reads the run's own config and takes --out; generate takes neither a config nor a
  workdir: each gets the flags it reads, and a flag it does not read is refused."""
  out = _run([sys.executable, "launch/local.py", "--num_processes=2", "--port=4321",
              "--module=sage_jax.export", "--workdir=runs/demo", "--flag=out=runs/demo_hf",
              "--flag=--step=3", "--dry_run"])
  for line in out.strip().splitlines():
    assert line.endswith("-m sage_jax.export --out=runs/demo_hf --step=3 --workdir=runs/demo")
  wrong = subprocess.run([sys.executable, "launch/local.py", "--module=sage_jax.export",
                          "--config=configs/sage.py:demo", "--workdir=runs/demo", "--dry_run"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
  assert wrong.returncode != 0 and "sage_jax.export takes no --config" in wrong.stderr
  pod = _run([sys.executable, "launch/tpu_pod.py", "--project=p", "--zone=z", "--tpu=t",
              "--module=sage_jax.generate", "--flag=model=/ckpt/Qwen2.5-32B-Instruct",
              "--flag=prompt=hi", "--dry_run"])
  assert ("python -m sage_jax.generate --model=/ckpt/Qwen2.5-32B-Instruct --prompt=hi > "
          "logs/$(hostname).log") in pod, pod
  missing = subprocess.run([sys.executable, "launch/tpu_pod.py", "--project=p", "--zone=z",
                            "--tpu=t", "--workdir=gs://b/run", "--dry_run"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
  assert missing.returncode != 0 and "sage_jax.train needs --config" in missing.stderr


def test_tpu_pod_dry_run_prints_every_step():
  out = _run([sys.executable, "launch/tpu_pod.py", "--project=proj", "--zone=us-east5-a",
              "--tpu=sage-v5p", "--accelerator_type=v5p-64", "--create",
              "--config=configs/sage.py:qwen2.5-32b", "--workdir=/mnt/shared/run",
              "--override=seed=1", "--dry_run"])
  lines = [shlex.split(line) for line in out.strip().splitlines()]
  assert [l[:5] for l in lines] == [
      ["gcloud", "compute", "tpus", "tpu-vm", "create"],
      ["git", "archive", "--format=tar.gz", f"--output={tpu_pod.ARCHIVE}", "HEAD"],
      ["gcloud", "compute", "tpus", "tpu-vm", "scp"],
      ["gcloud", "compute", "tpus", "tpu-vm", "ssh"],
      ["gcloud", "compute", "tpus", "tpu-vm", "ssh"],
      ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]]
  assert "--accelerator-type=v5p-64" in lines[0]
  for line in lines[2:5]:
    assert "--worker=all" in line and "--zone=us-east5-a" in line and "--project=proj" in line
  setup, run, follow = lines[3][-1], lines[4][-1], lines[5]
  assert "pip install -q -r requirements.txt -e ." in setup and "jax[tpu]==0.10.2" in setup
  # The interpreter is checked before the venv is made from it.
  assert f"cd sage_jax && {tpu_pod.python_check('python3')} && python3 -m venv .venv" in setup
  # Detached from the ssh session, one log per worker.
  assert ("SAGE_JAX_JOIN_TPU_POD=1 setsid nohup python -m sage_jax.train "
          "--config=configs/sage.py:qwen2.5-32b --workdir=/mnt/shared/run --config.seed=1 > "
          "logs/$(hostname).log") in run
  from sage_jax import multihost  # noqa: PLC0415
  assert tpu_pod.JOIN_ENV == multihost.TPU_POD_ENV  # what initialize() reads
  assert run.endswith("< /dev/null & }")
  assert "--worker=0" in follow and follow[-1] == "--command=tail -F sage_jax/logs/$(hostname).log"


def test_tpu_pod_start_returns_while_the_run_goes_on(tmp_path):
  """ssh returns once every stream of the remote command is closed: the start command must
  end at once, leaving only the detached run (here a `setsid` that sleeps) behind."""
  (tmp_path / "sage_jax" / ".venv" / "bin").mkdir(parents=True)
  (tmp_path / "sage_jax" / ".venv" / "bin" / "activate").write_text("")
  (tmp_path / "sage_jax" / "logs").mkdir()
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "setsid").write_text("#!/bin/sh\nexec sleep 5\n")
  (bin_dir / "setsid").chmod(0o755)
  commands = tpu_pod.build(project="p", zone="z", tpu="t", config="configs/sage.py:demo",
                           workdir="/tmp/run")
  run = commands[-1][-1].removeprefix("--command=")
  start = time.monotonic()
  done = subprocess.run(["bash", "-c", run], cwd=tmp_path, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, timeout=30,
                        env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}"))
  assert done.returncode == 0, done.stderr
  assert time.monotonic() - start < 3  # not the 5 s of the run


def test_tpu_pod_setup_refuses_an_old_python_in_one_line(monkeypatch):
  """The TPU VM images' python3 is 3.10; the setup stops there with a line naming the
  requirement and --python, before pip fails on a pin it finds no version of."""
  import tomllib  # noqa: PLC0415

  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    requires = tomllib.load(f)["project"]["requires-python"]
  assert requires == ">=" + ".".join(map(str, tpu_pod.PYTHON_REQUIRED))
  ok = subprocess.run(["bash", "-c", tpu_pod.python_check(sys.executable)], capture_output=True,
                      text=True, timeout=60)
  assert ok.returncode == 0, ok.stderr
  newer = (sys.version_info.major, sys.version_info.minor + 1)  # what this interpreter lacks
  monkeypatch.setattr(tpu_pod, "PYTHON_REQUIRED", newer)
  old = subprocess.run(["bash", "-c", tpu_pod.python_check(sys.executable)],
                       capture_output=True, text=True, timeout=60)
  required = f"{newer[0]}.{newer[1]}"
  version = ".".join(map(str, sys.version_info[:3]))
  assert old.returncode == 1 and old.stderr == (
      f"sage_jax needs Python >= {required}; {sys.executable} is {version}: pass "
      f"--python=python{required} (or the path of a uv-managed interpreter)\n")
  out = _run([sys.executable, "launch/tpu_pod.py", "--project=p", "--zone=z", "--tpu=t",
              "--python=python3.11", "--config=configs/sage.py:demo", "--workdir=gs://b/r",
              "--dry_run"])
  assert "python3.11 -c " in out and "python3.11 -m venv .venv" in out
  sweep_out = _run([sys.executable, "launch/sweep.py", "--workdir_root=r",
                    "--sweep=configs/sweeps/chain_length.py:demo", "--launcher=tpu_pod",
                    "--project=p", "--zone=z", "--tpu=pod-{name}", "--python=python3.11",
                    "--dry_run"])
  assert sweep_out.count("python3.11 -m venv .venv") == 3


def test_tpu_pod_queued_resource_waits_until_active():
  argv = [sys.executable, "launch/tpu_pod.py", "--project=proj", "--zone=us-east5-a",
          "--tpu=sage-v5p", "--accelerator_type=v5p-64", "--create", "--queued", "--spot",
          "--config=configs/sage.py:qwen2.5-32b", "--workdir=/mnt/shared/run", "--dry_run"]
  lines = [shlex.split(line) for line in _run(argv).strip().splitlines()]
  assert lines[0][:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "sage-v5p"]
  assert {"--node-id=sage-v5p", "--accelerator-type=v5p-64", "--spot"} <= set(lines[0])
  assert lines[1][:2] == ["bash", "-c"] and "= ACTIVE ]" in lines[1][2]
  assert "queued-resources describe sage-v5p" in lines[1][2]
  assert lines[2][:2] == ["git", "archive"]
  no_create = subprocess.run(argv[:6] + argv[7:], cwd=REPO, capture_output=True, text=True)
  assert no_create.returncode != 0 and "needs --create" in no_create.stderr
  # Spot capacity is a queued resource's: without --queued it would silently be on-demand.
  on_demand = subprocess.run(argv[:7] + argv[8:], cwd=REPO, capture_output=True, text=True)
  assert on_demand.returncode != 0 and "needs --create --queued" in on_demand.stderr


def test_slurm_dry_run(tmp_path):
  fake_bin = tmp_path / "bin"
  fake_bin.mkdir()
  # SLURM is not installed here: this stands in for `scontrol show hostnames`.
  (fake_bin / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-node-1\\ngpu-node-2\\n'\n")
  (fake_bin / "scontrol").chmod(0o755)
  env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-node-[1-2]",
         "SLURM_NNODES": "2", "SLURM_SUBMIT_DIR": str(tmp_path), "DRY_RUN": "1"}
  out = _run(["bash", "launch/slurm.sbatch", "--config=configs/sage.py:qwen2.5-32b",
              "--workdir=/shared/run x"], env)
  first, second = out.strip().splitlines()
  assert first == "JAX_COORDINATOR_ADDRESS=gpu-node-1:12345 JAX_NUM_PROCESSES=2"
  argv = shlex.split(second)
  assert argv[:4] == ["srun", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
  assert argv[4] == f"--output={tmp_path}/logs/%x-%j-node%t.log"
  assert argv[5:7] == ["bash", "-c"] and 'export JAX_PROCESS_ID="$SLURM_PROCID"' in argv[7]
  assert argv[-2:] == ["--config=configs/sage.py:qwen2.5-32b", "--workdir=/shared/run x"]


def test_slurm_dry_run_outside_an_allocation(tmp_path):
  """As documented: DRY_RUN=1 prints the srun command without an allocation (placeholders
  for the nodes) and creates nothing; a real run there is refused in one line."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  env["SAGE_JAX_DIR"] = str(tmp_path)
  argv = ["bash", "launch/slurm.sbatch", "--config=configs/sage.py:demo", "--workdir=/tmp/x"]
  out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**env, "DRY_RUN": "1"})
  assert out.returncode == 0, out.stderr
  first, second = out.stdout.strip().splitlines()
  assert first == "JAX_COORDINATOR_ADDRESS=<head_node>:12345 JAX_NUM_PROCESSES=<nodes>"
  assert shlex.split(second)[:4] == ["srun", "--ntasks=<nodes>", "--ntasks-per-node=1",
                                     "--kill-on-bad-exit=1"]
  assert "not checked before the tasks start" in out.stderr  # no venv in SAGE_JAX_DIR
  assert not (tmp_path / "logs").exists()
  real = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
  assert real.returncode == 2 and real.stderr.startswith(
      "slurm.sbatch: not inside a SLURM allocation"), real.stderr


def test_multinode_dry_run():
  out = _run(["bash", "launch/multinode.sh", "--config=configs/sage.py:qwen2.5-7b",
              "--workdir=/shared/run"], {"HOSTS": "h0 h1 h2", "DRY_RUN": "1"})
  lines = [shlex.split(line) for line in out.strip().splitlines()]
  assert [l[:2] for l in lines] == [["ssh", "h0"], ["ssh", "h1"], ["ssh", "h2"]]
  for i, (_, _, remote) in enumerate(lines):
    assert (f"JAX_COORDINATOR_ADDRESS=h0:12345 JAX_NUM_PROCESSES=3 JAX_PROCESS_ID={i} "
            "exec python -m sage_jax.train --config=configs/sage.py:qwen2.5-7b "
            "--workdir=/shared/run") in remote
    assert f"echo $$ > logs/h{i}.pid" in remote  # what Ctrl-C at the launcher signals
  # user@host: the host's name is the coordinator's address and names its files.
  out = _run(["bash", "launch/multinode.sh", "--workdir=/shared/run"],
             {"HOSTS": "me@h0 h1", "DRY_RUN": "1"})
  (_, host, remote), _ = [shlex.split(line) for line in out.strip().splitlines()]
  assert host == "me@h0" and "JAX_COORDINATOR_ADDRESS=h0:12345 " in remote
  assert "echo $$ > logs/h0.pid" in remote and "> logs/h0.log" in remote


def _hosts_here(tmp_path, hosts: str, job: str, ssh: str = "bash") -> tuple:
  """(the launcher's environment, the checkout): `ssh` here runs the command on this machine
  (`ssh` = "setsid bash": in a session of its own, as a remote shell runs beyond the reach of
  the launcher's terminal), in a checkout whose module `job` holds `job`."""
  bin_dir, code = tmp_path / "bin", tmp_path / "code"
  bin_dir.mkdir()
  (bin_dir / "ssh").write_text(f'#!/bin/sh\nshift\nexec {ssh} -c "$*"\n')
  (bin_dir / "ssh").chmod(0o755)
  (code / ".venv" / "bin").mkdir(parents=True)
  (code / ".venv" / "bin" / "activate").write_text("")
  (code / "job.py").write_text(job)
  env = {**os.environ, "HOSTS": hosts, "SAGE_JAX_DIR": str(code), "SAGE_JAX_MODULE": "job",
         "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
  return env, code


def test_multinode_exits_with_the_first_failing_hosts_status_and_names_each(tmp_path):
  env, code = _hosts_here(tmp_path, "h0 u@h1 h2", "import os, sys\n"
                          "sys.exit([0, 5, 3][int(os.environ['JAX_PROCESS_ID'])])\n")
  done = subprocess.run(["bash", "launch/multinode.sh", "--workdir=w"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 5, done.stderr
  assert (f"multinode.sh: u@h1 exited with status 5 (its log: {code}/logs/h1.log there)"
          in done.stderr), done.stderr
  assert "h2 exited with status 3" in done.stderr and "h0 exited" not in done.stderr


def test_multinode_ctrl_c_stops_every_host_process_once(tmp_path):
  """Ctrl-C at the launcher reaches every host's process as one SIGTERM (which a run answers
  by saving a checkpoint after its step); `ssh` here runs the command in a session of its
  own on this machine, as a remote shell runs beyond the reach of the launcher's terminal."""
  import signal  # noqa: PLC0415
  env, code = _hosts_here(
      tmp_path, "h0 h1",
      "import os, signal, sys, time\n"
      "def stop(*_):\n"
      "  open(f'stopped_{os.environ[\"JAX_PROCESS_ID\"]}', 'a').write('SIGTERM\\n')\n"
      "  sys.exit(143)\n"
      "signal.signal(signal.SIGTERM, stop)\n"
      "time.sleep(300)\n", ssh="setsid bash")
  # As from a terminal: SIGINT at its default (a job started in the background, as CI may
  # start this test, inherits it ignored, and bash cannot trap a signal ignored at entry).
  launcher = subprocess.Popen(["bash", "launch/multinode.sh", "--workdir=w"], cwd=REPO, env=env,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  pid_files = [code / "logs" / f"h{i}.pid" for i in (0, 1)]
  try:
    deadline = time.time() + 60
    while not all(p.exists() and p.read_text().strip() for p in pid_files):
      assert time.time() < deadline and launcher.poll() is None
      time.sleep(0.2)
    time.sleep(0.5)  # the processes are running Python by now
    os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
    _, err = launcher.communicate(timeout=60)
  finally:
    launcher.kill()
    for pid_file in pid_files:  # nothing left running if the test failed
      if pid_file.exists() and pid_file.read_text().strip():
        subprocess.run(["kill", "-9", pid_file.read_text().strip()], check=False,
                       stderr=subprocess.DEVNULL)
  assert launcher.returncode == 143, err
  assert "stopping every process after its step" in err
  for i in (0, 1):
    assert (code / f"stopped_{i}").read_text() == "SIGTERM\n"


def test_multinode_without_hosts_fails_clearly():
  out = subprocess.run(["bash", "launch/multinode.sh"], cwd=REPO, capture_output=True,
                       text=True, env={k: v for k, v in os.environ.items() if k != "HOSTS"})
  assert out.returncode == 2 and "set HOSTS" in out.stderr


@pytest.mark.parametrize("name,runs", [
    ("reward_ablation.py", ["outcome_only", "chain_based", "skill_integrated"]),
    ("chain_length.py", ["k1", "k2", "k3"]),
    ("retrieval.py:runs/sage:4",
     ["same_scenario", "query_ngram", "query_embedding", "skill_embedding"]),
    ("seeds.py", ["sage-seed0", "sage-seed1", "sage-seed2",
                  "grpo-seed0", "grpo-seed1", "grpo-seed2",
                  "grpo_matched-seed0", "grpo_matched-seed1", "grpo_matched-seed2"]),
    ("seeds.py:demo:2", ["sage-seed0", "sage-seed1", "grpo-seed0", "grpo-seed1",
                         "grpo_matched-seed0", "grpo_matched-seed1"]),
])
def test_sweeps_expand(name, runs):
  expanded = sweep.expand(sweep.load_sweep(os.path.join(SWEEPS, name)), "runs/x")
  assert [r.name for r in expanded] == runs
  assert all(r.workdir == f"runs/x/{r.name}" for r in expanded)


def _resolved(run):
  """The run config an arm's command resolves to."""
  from sage_jax import run_config  # noqa: PLC0415
  from tests.test_run_config import _config  # noqa: PLC0415

  name, preset = os.path.basename(run.config).split(".py:")
  config = _config(name, preset)
  for key, value in run.overrides.items():
    *sections, leaf = key.split(".")
    target = config
    for section in sections:
      target = target[section]
    target[leaf] = value
  return run_config.resolve(config)


@pytest.mark.parametrize("preset", ["demo", "qwen2.5-coder-0.5b", "qwen2.5-7b", "qwen2.5-32b"])
def test_seed_sweep_arms_are_their_stage_commands(preset):
  """Each arm is its stage config plus the swept keys; the matched baseline runs as many
  episodes per update as SAGE; seeds reach every component."""
  runs = {r.name: r for r in sweep.expand(
      sweep.load_sweep(os.path.join(SWEEPS, f"seeds.py:{preset}")), "r")}
  assert runs["grpo-seed1"].config == f"configs/grpo.py:{preset}"
  assert runs["grpo-seed1"].overrides == {"seed": 1}
  assert runs["sage-seed1"].config == f"configs/sage.py:{preset}"
  sage, grpo, matched = (_resolved(runs[f"{arm}-seed1"])
                         for arm in ("sage", "grpo", "grpo_matched"))
  assert (grpo.agent.use_library, grpo.reward.variant, grpo.rollout.single_task) == (
      False, "outcome", True)

  def episodes(run):
    return (run.pipeline.chains_per_step * run.rollout.group_size
            * run.rollout.effective_chain_length)

  assert episodes(matched) == episodes(sage) > episodes(grpo)
  assert sage.seed == grpo.seed == 1 and sage.model.seed != _resolved(runs["sage-seed0"]).model.seed


def test_sweep_dry_run_for_every_launcher():
  base = [sys.executable, "launch/sweep.py", "--sweep=configs/sweeps/chain_length.py:demo",
          "--workdir_root=runs/k", "--dry_run"]
  local_out = _run(base + ["--launcher=local"])
  assert local_out.count("-m sage_jax.train --config=configs/sage.py:demo") == 3
  assert "--workdir=runs/k/k2 --config.grpo.chain_length=2" in local_out
  slurm_out = _run(base + ["--launcher=slurm"])
  assert "sbatch --job-name=k3" in slurm_out and "launch/slurm.sbatch" in slurm_out
  # sbatch options for every run, before the script (after it they would be its arguments).
  nodes = _run(base + ["--launcher=slurm", "--sbatch_arg=--nodes=1",
                       "--sbatch_arg=--partition=gpu"])
  assert nodes.count("--export=ALL,SAGE_JAX_MODULE=sage_jax.train --nodes=1 --partition=gpu "
                     f"{REPO}/launch/slurm.sbatch --config=configs/sage.py:demo") == 3, nodes
  assert _fails(base + ["--launcher=local", "--sbatch_arg=--nodes=1"]).endswith(
      "--sbatch_arg is for --launcher=slurm, not local")
  assert _fails(base + ["--launcher=slurm", "--sbatch_arg=--export=NONE"]).endswith(
      "--sbatch_arg=--export=NONE: the sweep sets the job name and "
      "--export=ALL,SAGE_JAX_MODULE=<module> of each run itself")
  multi_out = _run(base + ["--launcher=multinode"])
  assert multi_out.count("launch/multinode.sh") == 3
  tpu_out = _run(base + ["--launcher=tpu_pod", "--project=p", "--zone=z", "--tpu=pod-{name}"])
  assert "tpu-vm ssh pod-k1 --worker=all" in tpu_out
  # Each run is started, not followed: a sweep's launcher must not block on the first log.
  assert "tail -F" not in tpu_out and tpu_out.count("setsid nohup") == 3
  seeds = _run([sys.executable, "launch/sweep.py", "--sweep=configs/sweeps/seeds.py:demo:1",
                 "--workdir_root=r", "--dry_run", "--launcher=tpu_pod", "--project=p",
                 "--zone=z", "--tpu=sage-{name}"])  # Cloud TPU names take no underscores
  assert "tpu-vm ssh sage-grpo-matched-seed0 --worker=all" in seeds, seeds
  shared = subprocess.run(base + ["--launcher=tpu_pod", "--project=p", "--zone=z",
                                  "--tpu=pod"], cwd=REPO, capture_output=True, text=True)
  assert shared.returncode != 0 and "3 runs would share one slice" in shared.stderr


def test_a_sweep_override_reaches_every_run_and_may_not_undo_the_sweep():
  """The checkpoint a real-size preset starts from, for every arm of a sweep."""
  name = "reward_ablation.py:qwen2.5-7b"
  base = [sys.executable, "launch/sweep.py", f"--sweep=configs/sweeps/{name}",
          "--workdir_root=r", "--launcher=slurm", "--dry_run"]
  out = _run(base + ["--override=model.spec=/ckpt/Qwen2.5-7B-Instruct"])
  assert out.count("--config.model.spec=/ckpt/Qwen2.5-7B-Instruct") == 3, out
  for run in sweep.expand(sweep.load_sweep(os.path.join(SWEEPS, name)), "r",
                          {"model.spec": "/ckpt/Qwen2.5-7B-Instruct"}):
    resolved = _resolved(run)
    assert (resolved.model.spec, resolved.model.preset) == ("/ckpt/Qwen2.5-7B-Instruct",
                                                            "qwen2.5-7b")
  undo = subprocess.run(base + ["--override=reward.variant=sage"], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert undo.returncode != 0
  assert "--override of ['reward.variant']: run 'outcome_only' sets it" in undo.stderr


def test_readme_reward_ablation_dry_run():
  """The README's command: each arm of the 7B preset asks for the one node it needs."""
  out = _run([sys.executable, "launch/sweep.py",
              "--sweep=configs/sweeps/reward_ablation.py:qwen2.5-7b",
              "--workdir_root=runs/reward_ablation", "--launcher=slurm",
              "--sbatch_arg=--nodes=1", "--dry_run"])
  for name, variant in (("outcome_only", "outcome"), ("chain_based", "chain"),
                        ("skill_integrated", "sage")):
    assert (f"sbatch --job-name={name} --export=ALL,SAGE_JAX_MODULE=sage_jax.train --nodes=1 "
            f"{REPO}/launch/slurm.sbatch --config=configs/sage.py:qwen2.5-7b "
            f"--workdir=runs/reward_ablation/{name} --config.reward.variant={variant}") in out, out


def test_retrieval_sweep_evaluates_one_trained_run(tmp_path):
  """Its arms evaluate the run's latest checkpoint (when the sweep is expanded) under each
  strategy; nothing trains."""
  run = tmp_path / "run"
  for step in ("2", "10", "12.orbax-checkpoint-tmp-1"):  # the last: an unfinished save
    (run / "checkpoints" / step).mkdir(parents=True)
  out = _run([sys.executable, "launch/sweep.py", f"--sweep=configs/sweeps/retrieval.py:{run}",
              "--workdir_root=runs/retrieval", "--dry_run"])
  strategies = ("same_scenario", "query_ngram", "query_embedding", "skill_embedding")
  assert out.splitlines() == [line for s in strategies for line in (
      f"# {s}",
      shlex.join([sys.executable, "-m", "sage_jax.evaluate", f"--run={run}", "--step=10",
                  "--config=configs/eval.py:run", f"--workdir=runs/retrieval/{s}",
                  f"--config.retrieval.strategy={s}"]))]
  slurm = _run([sys.executable, "launch/sweep.py",
                f"--sweep=configs/sweeps/retrieval.py:{run}:2", "--workdir_root=r",
                "--launcher=slurm", "--dry_run"])
  assert slurm.count("SAGE_JAX_MODULE=sage_jax.evaluate") == 4
  assert f"--run={run} --step=2 --config=configs/eval.py:run --workdir=r/query_ngram" in slurm
  with pytest.raises(config_file.ConfigFileError, match="no checkpoint to evaluate"):
    sweep.load_sweep(f"configs/sweeps/retrieval.py:{tmp_path / 'untrained'}")
  # A step the run does not have (or has not finished saving): every arm would fail.
  for step in ("999", "12"):
    with pytest.raises(config_file.ConfigFileError,
                       match=rf"no finished checkpoint step {step}; its steps: \[2, 10\]"):
      sweep.load_sweep(f"configs/sweeps/retrieval.py:{run}:{step}")
  with pytest.raises(config_file.ConfigFileError, match="evaluates a trained run"):
    sweep.load_sweep("configs/sweeps/retrieval.py")
  wrong = subprocess.run([sys.executable, "launch/sweep.py", "--module=sage_jax.train",
                          f"--sweep=configs/sweeps/retrieval.py:{run}", "--workdir_root=r",
                          "--dry_run"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert wrong.returncode != 0 and "runs sage_jax.evaluate" in wrong.stderr


def test_retrieval_sweep_evaluates_a_run_in_a_bucket(gcs_url):
  from sage_jax import storage  # noqa: PLC0415
  from tests import fake_gcs  # noqa: PLC0415

  # A bucket of its own: the GCS server is the session's, shared with other tests.
  fake_gcs.create_bucket(gcs_url, "sweep-runs")
  for step in ("3", "7"):  # orbax marks a finished step in a bucket last
    storage.write_text(f"gs://sweep-runs/sage/checkpoints/{step}/commit_success.txt", "")
  storage.write_text("gs://sweep-runs/sage/checkpoints/9/state/data", "")  # a save under way
  assert sweep.split_spec("retrieval.py:gs://sweep-runs/sage:3") == [
      "retrieval.py", "gs://sweep-runs/sage", "3"]
  for spec, step in (("gs://sweep-runs/sage", 7), ("gs://sweep-runs/sage:3", 3)):
    loaded = sweep.load_sweep(os.path.join(SWEEPS, f"retrieval.py:{spec}"))
    assert loaded["flags"] == {"run": "gs://sweep-runs/sage", "step": step}


def test_a_failed_run_does_not_stop_the_sweep(tmp_path, capfd):
  """The arm after a failed one still runs; the sweep names the failures."""
  def touch(name):
    return [sys.executable, "-c", f"open({str(tmp_path / name)!r}, 'w')"]
  failing = [sys.executable, "-c", "raise SystemExit(3)"]
  failed = sweep.run_all({"a": [failing, touch("a_after")], "b": [touch("b")]})
  assert failed == ["a"]
  assert (tmp_path / "b").exists() and not (tmp_path / "a_after").exists()
  assert "# a failed (exit status 3)" in capfd.readouterr().err


def test_sweep_errors_are_clear():
  with pytest.raises(ValueError, match="needs --project, --zone"):
    sweep.commands_for(sweep.Run("a", "c.py:x", {}, "w"), "tpu_pod", tpu="t")
  with pytest.raises(ValueError, match="set \\['seed'\\] twice"):
    sweep.expand({"config": "c", "axes": [{"a": {"seed": 1}}, {"b": {"seed": 2}}]}, "r")
  with pytest.raises(ValueError, match="override 'seed' is not KEY=VALUE"):
    common.parse_overrides(["seed"])


def test_shell_scripts_pass_shellcheck():
  if shutil.which("shellcheck") is None:
    if os.environ.get("CI"):
      pytest.fail("shellcheck is not installed (CI installs it from Debian's packages)")
    pytest.skip("shellcheck not installed")
  scripts = ["launch/slurm.sbatch", "launch/multinode.sh", ".ci/run"]
  out = subprocess.run(["shellcheck", *scripts], cwd=REPO, capture_output=True, text=True)
  assert out.returncode == 0, out.stdout


def _fails(argv, env=None) -> str:
  """The one line a launcher exits with (after absl's usage text, for a UsageError); it
  printed no command."""
  out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **(env or {})})
  assert out.returncode != 0 and "--workdir=" not in out.stdout, (out.stdout, out.stderr)
  return out.stderr.strip().splitlines()[-1]


def test_a_tuple_of_strings_reaches_the_run_as_that_tuple():
  from tests.test_sweep_arms import _resolve_command  # noqa: PLC0415

  for stages in [("sft", "rl"), ("rl",)]:
    argv = common.entry_command("configs/sage.py:demo", "w", {"pipeline.stages": stages})
    assert _resolve_command(argv[3:]).pipeline.stages == stages


@pytest.mark.parametrize("override,line", [
    ("grpo.gruop_size=4", "run 'k1': --config.grpo.gruop_size=4: config section 'grpo' has no "
                          "key 'gruop_size'"),
    ("grpo.group_size=four", "run 'k1': flag --config.grpo.group_size=four: invalid literal"),
    ("grpo.group_size=1", "run 'k1': ConfigError: config.grpo.group_size"),
])
def test_every_run_of_a_sweep_is_checked_before_any_starts(override, line):
  """A key the entry point would refuse fails the sweep at once, in one line naming the run,
  instead of N jobs that each start and fail (on a TPU slice: after its setup)."""
  for launcher in ("local", "slurm"):
    got = _fails([sys.executable, "launch/sweep.py", "--sweep=configs/sweeps/chain_length.py:demo",
                  "--workdir_root=r", f"--launcher={launcher}", f"--override={override}",
                  "--dry_run"])
    assert got.startswith(line), got
  got = _fails([sys.executable, "launch/local.py", "--config=configs/sage.py:demo",
                "--workdir=w", f"--override={override}", "--dry_run"])
  assert got.startswith(line.removeprefix("run 'k1': ")), got
  got = _fails(["bash", "launch/multinode.sh", "--config=configs/sage.py:demo", "--workdir=w",
                f"--config.{override}"], {"HOSTS": "h0 h1", "DRY_RUN": "1"})
  assert got.startswith(line.removeprefix("run 'k1': ")), got


def test_a_launch_refuses_a_tuple_key_given_twice_as_whole_tuples():
  """The launchers check before any host starts; ml_collections' own form of a repeated tuple
  override (one element each) still builds the tuple."""
  twice = ["--config=configs/sage.py:demo", "--workdir=w",
           "--config.batch.length_buckets=(512, 1024)", "--config.batch.length_buckets=[256]"]
  got = _fails(["bash", "launch/multinode.sh", *twice], {"HOSTS": "h0 h1", "DRY_RUN": "1"})
  assert got == ("--config.batch.length_buckets is given 2 times ((512, 1024), [256]), which "
                 "would set (512, 1024, 256): ml_collections joins repeated tuple overrides. "
                 "Give the whole tuple once."), got
  elements = ["--config.batch.length_buckets=1024", "--config.batch.length_buckets=2048"]
  common.check_command("sage_jax.train", ["--config=configs/sage.py:demo", *elements])
  values = flags.FlagValues()
  argv = ["m", "--config=configs/sage.py:demo", *elements]
  config_file.define_flag("config", "", flag_values=values, sys_argv=argv)
  values(argv)
  assert values.config.batch.length_buckets == (1024, 2048)
  assert config_file.joined_tuple_override(argv, values.config) is None


def test_sweep_misuse_fails_in_one_line(tmp_path):
  base = [sys.executable, "launch/sweep.py", "--workdir_root=r", "--dry_run"]
  chain = "--sweep=configs/sweeps/chain_length.py:demo"
  assert _fails(base + [chain, "--override=grpo.group_size=4",
                        "--override=config.grpo.group_size=8"]).endswith(
      "override 'grpo.group_size' is given twice ('4', '8')")
  assert _fails(base + [chain, "--launcher=tpu_pod", "--project=p", "--zone=z",
                        "--tpu=pod-{name}-{seed}"]).endswith(
      "only {name} (the run's name) is filled in, not {seed}")
  assert _fails(base + [chain, "--module=sage_jax.export"]).endswith(
      "sage_jax.export takes no --config (its own flags go as entry flags)")
  assert _fails(base + ["--sweep=configs/sweeps/seeds.py:demo:0"]).endswith(
      "NUM_SEEDS must be at least 1, got 0")
  bad = tmp_path / "bad.py"
  bad.write_text("def get_sweep():\n  return {'config': 'configs/sage.py:demo', "
                 "'axes': {'k1': {'grpo.chain_length': 1}}}\n")
  assert "get_sweep()['axes'] must be a list of" in _fails(base + [f"--sweep={bad}"])
  bad.write_text("def get_sweep():\n  return {'config': 'configs/sage.py:demo', 'axes': [{}]}\n")
  assert _fails(base + [f"--sweep={bad}"]).endswith("the sweep has no runs: axis 0 has no arms")


def test_retrieval_sweep_refuses_a_run_without_a_library(tmp_path):
  run = tmp_path / "run"
  (run / "checkpoints" / "2").mkdir(parents=True)
  (run / "config.json").write_text('{"agent": {"use_library": false}, "pipeline": {}}')
  with pytest.raises(config_file.ConfigFileError, match="keeps no skill library"):
    sweep.load_sweep(f"configs/sweeps/retrieval.py:{run}")


def test_the_launcher_names_the_process_that_failed_first_and_exits_as_it_did(tmp_path,
                                                                             monkeypatch, capsys):
  """Process 1 is killed; process 0 would wait on it: the launcher stops it after the grace
  period and exits with process 1's status (128 + 9), not with that of its own kill."""
  monkeypatch.setattr(local, "FAILURE_GRACE_S", 1.0)
  code = ("import os, signal, time\n"
          "if os.environ['JAX_PROCESS_ID'] == '1':\n  os.kill(os.getpid(), signal.SIGKILL)\n"
          "time.sleep(120)\n")
  status = local.run_processes([sys.executable, "-c", code], local.process_envs(2, 1, {}),
                               str(tmp_path / "logs"))
  err = capsys.readouterr().err
  assert status == 137, err
  assert "launch: process 1 exited with 137 (signal 9), the first to fail" in err
  assert "launch: process 0 was stopped by the launcher, 1 s after process 1 failed" in err


def test_the_first_to_fail_is_the_first_to_end_not_the_first_in_order(tmp_path, capsys):
  """Process 1 fails, and process 0 fails 50 ms after it (as a collective with a dead peer
  would): the launcher names process 1 and exits with its status, though it checks process 0
  first."""
  marker = tmp_path / "process_1_failed"
  code = ("import os, time\n"
          f"marker = {str(marker)!r}\n"
          "if os.environ['JAX_PROCESS_ID'] == '1':\n"
          "  open(marker, 'w').close()\n  os._exit(5)\n"
          "while not os.path.exists(marker):\n  time.sleep(0.001)\n"
          "time.sleep(0.05)\nos._exit(3)\n")
  status = local.run_processes([sys.executable, "-c", code], local.process_envs(2, 1, {}),
                               str(tmp_path / "logs"))
  err = capsys.readouterr().err
  assert status == 5, err
  assert "launch: process 1 exited with 5, the first to fail" in err
  assert "launch: process 0 exited with 3\n" in err
