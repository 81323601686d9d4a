"""The `arithmetic` environment: the embedded task (ptrain.data.tasks) as RL episodes.

The prompt is exactly the SFT records' user turn (`What is 347 + 589?`), so a policy
fine-tuned on the embedded task is rolled out on the prompts it learnt; the completion is
graded by the task's verifier (ptrain.envs.arithmetic: the last `Answer: n` line).
Components: format (an `Answer: n` line is there) and correct.

`demonstration(task)` is the SFT row's worked solution split for Nano's chat format: the
column lines as reasoning in <think>...</think>, then the `Answer: n` line the verifier reads.
"""

from __future__ import annotations

from typing import Any

from ptrain.data.tasks import ANSWER_PREFIX, Problem, check_answer, extract_answer, worked_solution
from ptrain.envs.base import Task
from ptrain.envs.single_turn import SingleTurnEnv


def judge_arithmetic(data: dict[str, Any], completion: str) -> float:
    """1.0 when completion's final `Answer: n` equals data["answer"], else 0.0."""
    return float(check_answer(data, completion))


class ArithmeticEnv(SingleTurnEnv):
    """Multi-digit + - * problems with worked solutions (options: ArithmeticOptions)."""

    kind = "arithmetic"
    judge = staticmethod(judge_arithmetic)

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        from ptrain.data import tasks as arithmetic_tasks

        o = self.options
        try:
            train, held = arithmetic_tasks.generate_problems(
                self.cfg.n_train,
                self.cfg.n_eval,
                ops=o.ops,
                min_digits=o.min_digits,
                max_digits=o.max_digits,
                seed=seed,
            )
        except ValueError as e:
            raise ValueError(
                f"envs.{self.name}: cannot draw {self.cfg.n_train} + {self.cfg.n_eval} distinct problems with "
                f"ops={o.ops} and digits {o.min_digits}..{o.max_digits}; lower envs.{self.name}.n_train or raise "
                f"envs.{self.name}.options.max_digits ({str(e).split('; ')[0]})"
            ) from None

        def make(split: str, problems) -> list[Task]:
            return [
                self.task(split, i, arithmetic_tasks.chat_record(p)["messages"][:1], p.metadata())
                for i, p in enumerate(problems)
            ]

        return make("train", train), make("eval", held)

    def extract(self, task: Task, text: str) -> str | None:
        return text if extract_answer(text) is not None else None

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The turns a correct policy writes for `task` (after task.messages): one assistant
        turn, `<think>` the column-by-column lines of `worked_solution` `</think>Answer: n`."""
        d = task.data
        problem = Problem(d["op"], int(d["a"]), int(d["b"]))
        *columns, answer = worked_solution(problem).split("\n")
        if not answer.startswith(ANSWER_PREFIX) or not check_answer(dict(d), answer):
            raise ValueError(
                f"env {self.name} task {task.id}: the worked solution of {problem.question()!r} ends in {answer!r}, "
                f"not the task's answer {d['answer']}; the task's data does not match its problem"
            )
        return [{"role": "assistant", "content": "<think>" + "\n".join(columns) + f"</think>{answer}"}]

    def judge_args(self, task: Task, answer: str) -> tuple:
        return (dict(task.data), answer)
