"""The calculator environment of the agentic main job: one tool, ``calc``, called in the
compact format the tiny character model can learn (``[calc 123*45]`` -> ``(5535)``).

    [rollout.agent]
    environment = "calculator.py:Calculator"
    environment_kwargs = { enabled = false }    # the control run: every call is an error
"""

from __future__ import annotations

import ast
import operator

from geartrain.agents import ToolEnvironment

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def calc(expression: str) -> str:
    """Evaluate integer arithmetic: + - * // on integers, parentheses allowed."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"cannot evaluate {expression!r}")

    return str(ev(ast.parse(expression, mode="eval").body))


class Calculator(ToolEnvironment):
    """The ``calc`` tool behind the compact call format; ``enabled = false`` leaves the
    tool out (the model's calls then fail), the control run."""

    def __init__(self, enabled: bool = True, timeout_s: float = 2.0) -> None:
        super().__init__([calc] if enabled else [], call_format="compact", timeout_s=timeout_s)
