"""The Skill Library Agent's task episode: prompt, turns, code execution, skill events.

`run_task` drives one task in one started AppWorld episode: it builds the conversation token
by token (Qwen2.5 ChatML, append-only), asks the policy for each assistant turn, runs the
turn's code in the world, appends the output as an observation, and stops when the task is
completed, a limit is hit (steps, tokens), or the environment fails. Before each turn it
raises `stopping.StopRequested` if a signal asked the work around it to end early (a dev
evaluation). It knows nothing of rewards or of how the episode is scored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from sage_jax import stopping
from sage_jax.agent import parsing, prompts
from sage_jax.agent.config import AgentConfig
from sage_jax.agent.library import Skill
from sage_jax.agent.policy import Policy, TaskContext, TurnRequest
from sage_jax.agent.skills import (FAILED_PREFIX, BlockTrace, FunctionInfo, SkillEvents,
                                   SkillTracker)
from sage_jax.tokenizer import Conversation, Tokenizer

TRUNCATED = ("max_new_tokens", "context_full")  # finish reasons of a turn cut by a token limit
END_REASONS = ("completed", "max_steps", "token_limit", "env_error")


@dataclasses.dataclass(frozen=True)
class TurnRecord:
  """One assistant turn: its generated ids are conversation[token_start:token_end]."""

  token_start: int
  token_end: int
  text: str
  code: str | None  # None: no code block (format error)
  output: str | None  # AppWorld's output (None when nothing ran)
  exec_ok: bool | None
  finish_reason: str


@dataclasses.dataclass
class TaskTrace:
  """Everything one task episode produced on the agent side."""

  task_id: str
  scenario: str
  instruction: str
  conversation: Conversation
  sampler_logprobs: np.ndarray  # float32 [len(conversation)], 0 off generated tokens
  model_logprobs: np.ndarray
  turns: list[TurnRecord]
  events: SkillEvents
  saved: dict[str, FunctionInfo]  # what the library should store from this task
  visible_skills: tuple[Skill, ...]
  end_reason: str
  library_ok: bool | None = None
  env_error: str | None = None

  @property
  def num_steps(self) -> int:
    return len(self.turns)

  @property
  def generated_tokens(self) -> int:
    return sum(t.token_end - t.token_start for t in self.turns)

  @property
  def no_code_turns(self) -> int:
    """Turns that ended on their own without a code block."""
    return sum(t.code is None and t.finish_reason not in TRUNCATED for t in self.turns)

  @property
  def truncated_turns(self) -> int:
    """Turns without a code block because a token limit cut them."""
    return sum(t.code is None and t.finish_reason in TRUNCATED for t in self.turns)


class _Budget:
  """Token arithmetic of the episode limit (prompt + generations + observations)."""

  def __init__(self, tokenizer: Tokenizer, config: AgentConfig):
    self.limit = config.max_episode_tokens
    self.turn_limit = config.max_turn_tokens
    self.header = 1 + len(tokenizer.encode("assistant\n"))  # <|im_start|>assistant\n
    self.closing = 1 + len(tokenizer.newline_ids)  # <|im_end|>\n
    self._tok = tokenizer

  def turn_tokens(self, length: int) -> int:
    """New tokens a turn may generate after `length` tokens (<= 0: no room for a turn)."""
    return min(self.turn_limit, self.limit - length - self.header - self.closing)

  def fits_observation(self, length: int, text: str) -> bool:
    size = 1 + len(self._tok.encode(f"user\n{text}")) + self.closing
    return self.turn_tokens(length + size) >= 1


async def run_task(*, policy: Policy, episode: Any, tokenizer: Tokenizer, config: AgentConfig,
                   skills: Sequence[Skill] | None, scenario: str, seed: int = 0) -> TaskTrace:
  """Runs one task in `episode` (a started `AsyncEpisode`: `.start`, `execute`,
  `.last_trace`, `.task_completed`, `.error`). `skills`: the library skills shown (and already
  installed in the world); None runs the plain code agent without a library. An episode the
  environment failed to start (`.start` None) ends at once with its error, without a turn."""
  start = episode.start
  use_library = config.use_library and skills is not None
  shown = tuple(skills or ()) if use_library else ()
  system = prompts.system_prompt(shown if use_library else None, config.max_library_chars)
  if start is None:  # the environment failed while opening the task's world: nothing to do
    conv = Conversation(tokenizer, system)
    zeros = np.zeros(len(conv), np.float32)
    return TaskTrace(
        task_id=episode.task_id, scenario=scenario, instruction="", conversation=conv,
        sampler_logprobs=zeros, model_logprobs=zeros.copy(), turns=[],
        events=SkillTracker({}).events(), saved={}, visible_skills=shown,
        end_reason="env_error", env_error=episode.error or "the episode did not start")
  message = prompts.task_message(start.instruction, start.supervisor, start.datetime,
                                 start.app_descriptions)
  if start.library_ok is False:
    message += prompts.library_install_failure(start.library_output or "",
                                               config.max_observation_chars)
  conv = Conversation(tokenizer, system)
  conv.add_user(message)
  sample_lp: list[float] = [0.0] * len(conv)
  model_lp: list[float] = [0.0] * len(conv)
  tracker = SkillTracker({s.name: s.calls for s in shown})
  context = TaskContext(task_id=start.task_id, scenario=scenario, instruction=start.instruction,
                        skills=shown, use_library=use_library, seed=seed)
  budget = _Budget(tokenizer, config)
  turns: list[TurnRecord] = []
  end_reason, env_error = "max_steps", None
  seen = 0  # conversation ids the policy's sequence already holds
  session = policy.session(context)
  try:
    for step in range(config.max_steps):
      stopping.check()
      max_new = budget.turn_tokens(len(conv))
      if max_new < 1:
        end_reason = "token_limit"
        break
      prompt = conv.start_assistant()
      turn = await session.generate(TurnRequest(
          prompt_ids=prompt, new_ids=prompt[seen:], turn_index=step, max_new_tokens=max_new,
          max_context=budget.limit))
      first = len(conv)
      sample_lp += [0.0] * (first - len(sample_lp))  # the assistant header
      model_lp += [0.0] * (first - len(model_lp))
      conv.add_assistant_tokens(turn.tokens)
      seen = len(conv)
      sample_lp += [float(x) for x in turn.sample_logprobs]
      model_lp += [float(x) for x in turn.model_logprobs]
      conv.end_assistant()
      sample_lp += [0.0] * (len(conv) - len(sample_lp))
      model_lp += [0.0] * (len(conv) - len(model_lp))
      text = tokenizer.decode(turn.tokens, skip_special_tokens=True)
      code = parsing.extract_code(text).code
      output = ok = None
      if code is None:
        observation = prompts.FORMAT_ERROR
      else:
        try:
          output = await episode.execute(code)
        except Exception as e:  # noqa: BLE001 - AppWorld refused the request: end cleanly
          env_error = f"{type(e).__name__}: {e}"
          output = f"{FAILED_PREFIX} Traceback:\n{env_error}"
        ok = not output.startswith(FAILED_PREFIX)
        trace = None if env_error is not None or episode.last_trace is None else (
            BlockTrace.from_dict(episode.last_trace))
        tracker.observe(code, trace, output)
        observation = prompts.observation(output, config.max_observation_chars)
      turns.append(TurnRecord(first, seen, text, code, output, ok, turn.finish_reason))
      if env_error is None and getattr(episode, "error", None):
        env_error = episode.error
      if env_error is not None:
        end_reason = "env_error"
        break
      if code is not None and getattr(episode, "task_completed", False):
        end_reason = "completed"
        break
      if step + 1 == config.max_steps:
        end_reason = "max_steps"
        break
      if turn.finish_reason == "context_full" or not budget.fits_observation(len(conv),
                                                                               observation):
        end_reason = "token_limit"
        break
      conv.add_tool(observation)
      sample_lp += [0.0] * (len(conv) - len(sample_lp))
      model_lp += [0.0] * (len(conv) - len(model_lp))
  finally:
    await session.close()
  return TaskTrace(
      task_id=start.task_id, scenario=scenario, instruction=start.instruction,
      conversation=conv, sampler_logprobs=np.asarray(sample_lp, np.float32),
      model_logprobs=np.asarray(model_lp, np.float32), turns=turns, events=tracker.events(),
      saved=tracker.saved_functions() if use_library else {}, visible_skills=shown,
      end_reason=end_reason, library_ok=start.library_ok, env_error=env_error)
