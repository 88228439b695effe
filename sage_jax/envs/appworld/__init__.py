"""AppWorld for rollouts: a pool of worker processes, and a mini dataset built offline.

Importing this package never imports appworld (only the worker processes and the
mini-world builder do).
"""

from sage_jax.envs.appworld.config import EnvPoolConfig
from sage_jax.envs.appworld.data_root import AppWorldDataError
from sage_jax.envs.appworld.data_root import resolve as resolve_root
from sage_jax.envs.appworld.dataset import first_scenarios
from sage_jax.envs.appworld.dataset import group_by_scenario
from sage_jax.envs.appworld.dataset import read_split
from sage_jax.envs.appworld.dataset import scenario_id
from sage_jax.envs.appworld.evaluation import saved_dbs
from sage_jax.envs.appworld.mini_world import ensure_mini_world
from sage_jax.envs.appworld.pool import AsyncEpisode
from sage_jax.envs.appworld.pool import EnvPool
from sage_jax.envs.appworld.pool import Episode
from sage_jax.envs.appworld.pool import EpisodeError
from sage_jax.envs.appworld.results import EpisodeResult
from sage_jax.envs.appworld.results import EpisodeStart
from sage_jax.envs.appworld.results import Evaluation
from sage_jax.envs.appworld.results import scenario_goal_completion
from sage_jax.envs.appworld.results import task_goal_completion
