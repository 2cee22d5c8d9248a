"""``geartrain bench memory`` refuses what cannot work before measuring (issue 35, round 13):
a misspelled ``--candidates`` name was found after about 100 s of measuring and reported
inside the table (exit 0); a preset larger than the machine was attempted and ended in a page
of allocation tracebacks."""

from __future__ import annotations

import argparse
import os

from geartrain.bench_memory import CANDIDATES, _model_config, add_arguments, argument_problem, memory_problem
from geartrain.modeling import build_hf_model


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_an_unknown_candidate_is_refused_before_measuring() -> None:
    problem = argument_problem(_args("tiny", "--largest", "--candidates", "tiny", "qwen2.5-05b"), "cpu")
    assert problem == f"--candidates: unknown model(s) 'qwen2.5-05b'; choose from {', '.join(CANDIDATES)}"
    assert argument_problem(_args("tiny", "--largest", "--candidates", "tiny", "qwen2.5-0.5b"), "cpu") is None


def test_a_model_whose_update_step_cannot_fit_this_machine_is_refused() -> None:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name in CANDIDATES:
        need = 16 * sum(p.numel() for p in build_hf_model(_model_config(name), meta=True).parameters())
        problem = memory_problem(name, "cpu")
        if need > memory:
            assert problem is not None and problem.startswith(
                f"{name}'s update step needs at least {need / 2**30:,.1f} GiB on cpu"
            ), problem
            assert f"this machine's memory is {memory / 2**30:,.1f} GiB" in problem, problem
        else:
            assert problem is None, problem
    assert memory_problem("tiny", "cpu") is None
    assert memory_problem("llama3-8b", "cuda") is None  # a GPU's memory is the measurement's to find
