"""Configuration of the AppWorld environment pool."""

import dataclasses

from sage_jax.envs.appworld import data_root


@dataclasses.dataclass(frozen=True)
class EnvPoolConfig:
  """Everything that decides how the pool runs AppWorld; filled from the run's config."""
  # Worker processes, each holding at most one live world (one concurrent episode each).
  num_workers: int = 4
  # AppWorld data root (holds data/); None means $APPWORLD_ROOT.
  appworld_root: str | None = None
  # Where the pool remembers data roots whose every task it found complete (one empty file
  # per fingerprint of the root's task directories); None checks the root at every start.
  data_check_cache: str | None = "~/.cache/sage_jax/data_checks"
  # Where AppWorld writes experiment outputs (DB diffs, logs): <outputs_root>/experiments.
  # None gives the pool a temporary directory of its own, removed when it closes; runs set
  # it to their workdir. The data root is only written to when named here.
  outputs_root: str | None = None
  # Delete an episode's outputs once it is closed (its result record is kept in memory).
  keep_outputs: bool = True
  # Pool-side limit on one call (start, execute, evaluate, close), on top of AppWorld's own
  # timeout; a worker that does not answer in time is killed and replaced.
  call_timeout_s: float = 150.0
  # Limit on starting the workers' template process (interpreter start, imports, data check,
  # AppWorld's first world), on each request to it (fork or reap a worker; a template that
  # does not answer in time is replaced, its workers with it) and on a new worker's hello.
  start_timeout_s: float = 120.0
  # Address-space limit of each worker (RLIMIT_AS); None leaves it unlimited.
  memory_limit_mb: int | None = 4096
  # AppWorld's own settings of each world.
  max_interactions: int = 50
  timeout_seconds: int = 100
  random_seed: int = 100
  # Observations longer than this are cut (a 50 MB print must not reach the model).
  max_output_chars: int = 20_000
  # Disk an episode's directory may take (AppWorld's saves and logs, and whatever agent code
  # writes there; on the disk of outputs_root, a run's workdir). An episode that takes more
  # is stopped with its process and fails, its files removed at once; no single file can
  # grow past it. None leaves it unlimited.
  max_output_mb: int | None = 1024
  # How the process that runs agent code is confined (sandbox.py): "landlock" (the kernel
  # lets it read only the system and its own task's public files, write only beneath its
  # experiment directory, run no program, open no TCP connection and signal nothing outside;
  # seccomp refuses it every other socket and every new process but a thread; the pool
  # refuses to start where either is missing) or "off" (AppWorld's own Python-level guards
  # only: agent code can then read every task's answers).
  sandbox: str = "landlock"
  # Refuse agent code that reaches into the interpreter (frames, dunder attributes, the
  # builtins namespace; code_guard.py) before it runs: in-process, it could forge the call
  # records the skill rewards read, or the world's saves. Off only to test the layers below.
  code_guard: bool = True
  # Agent code still running this long after AppWorld's timeout_seconds (e.g. because it
  # switched the alarm off, or spins in C) is killed with its episode process by the worker,
  # and its episode ends there.
  kill_grace_s: float = 5.0
  # Limit on evaluating an episode's saved state, kept by the worker (evaluation.py): an
  # evaluation still running then is killed, and the episode counts as failed by the agent
  # (`Evaluation.refused`); AppWorld's evaluation of its own saves takes seconds.
  evaluation_timeout_s: float = 30.0
  # An episode the environment failed under (its worker crashed or stopped answering, or no
  # worker could be started: never the agent code's doing, whose faults end its episode as a
  # failure) is played again from its start, with the same skills and seed, up to this many
  # times, by rollouts and evaluations alike.
  episode_retries: int = 2
  # Serve each worker over HTTP on 127.0.0.1 instead of a socket.
  use_servers: bool = False
  # Directory for the logs of the workers (<slot>.log) and of their template process
  # (template.log): their stdout and stderr; None discards them. With several processes,
  # each writes to its process_<i>/ there.
  log_dir: str | None = None

  def __post_init__(self):
    if self.num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {self.num_workers}.")
    if self.timeout_seconds < 1:
      raise ValueError(f"timeout_seconds must be >= 1, got {self.timeout_seconds}.")
    if self.sandbox not in ("landlock", "off"):
      raise ValueError(f"sandbox must be 'landlock' or 'off', got {self.sandbox!r}.")
    if self.kill_grace_s <= 0:
      raise ValueError(f"kill_grace_s must be > 0, got {self.kill_grace_s}.")
    if self.evaluation_timeout_s <= 0:
      raise ValueError(f"evaluation_timeout_s must be > 0, got {self.evaluation_timeout_s}.")
    # The worker's own limits (an execution's, an evaluation's) must fire before the pool's.
    for name, limit in (("AppWorld's timeout_seconds", self.timeout_seconds),
                        ("evaluation_timeout_s", self.evaluation_timeout_s)):
      if self.call_timeout_s <= limit + self.kill_grace_s:
        raise ValueError(
          f"call_timeout_s ({self.call_timeout_s}) must exceed {name} ({limit}) + "
          f"kill_grace_s ({self.kill_grace_s}), so that the worker's own limits fire first.")
    if self.start_timeout_s <= 0:
      raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}.")
    if self.max_output_mb is not None and self.max_output_mb < 1:
      raise ValueError(f"max_output_mb must be >= 1 or None, got {self.max_output_mb}.")
    if self.memory_limit_mb is not None and self.memory_limit_mb < 512:
      raise ValueError(f"memory_limit_mb must be >= 512 (a worker holds ~300 MB), got "
                       f"{self.memory_limit_mb}.")
    if self.episode_retries < 0:
      raise ValueError(f"episode_retries must be >= 0, got {self.episode_retries}.")
    if self.max_interactions < 1 or self.max_output_chars < 1:
      raise ValueError("max_interactions and max_output_chars must be >= 1.")

  def data_root(self) -> str:
    """The AppWorld root to run (`data_root.resolve` of `appworld_root`)."""
    return data_root.resolve(self.appworld_root)
