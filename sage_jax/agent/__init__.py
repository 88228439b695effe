"""The Skill Library Agent: prompt, code parsing, skill events (AST), library, retrieval.

It drives a policy (model sampler or scripted expert) through AppWorld episodes; it knows
nothing of rewards or of the optimiser.
"""

from sage_jax.agent.agent import TaskTrace, TurnRecord, run_task
from sage_jax.agent.config import AgentConfig, RetrievalConfig
from sage_jax.agent.gold_solutions import ScriptedPolicy, expert_turns, expert_turns_for_task
from sage_jax.agent.library import Skill, SkillLibrary, install_code
from sage_jax.agent.parsing import extract_code
from sage_jax.agent.policy import Policy, PolicyTurn, TaskContext, TurnRequest
from sage_jax.agent.retrieval import Retriever
from sage_jax.agent.skills import SkillEvents, SkillTracker, analyze

__all__ = [
    "AgentConfig", "Policy", "PolicyTurn", "Retriever", "RetrievalConfig", "ScriptedPolicy",
    "Skill", "SkillEvents", "SkillLibrary", "SkillTracker", "TaskContext", "TaskTrace",
    "TurnRecord", "TurnRequest", "analyze", "expert_turns", "expert_turns_for_task",
    "extract_code", "install_code", "run_task",
]
