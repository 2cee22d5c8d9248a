"""Token-budget micro-batch planning, shared by the engines.

:func:`plan_micro_batches` decides which rows of a batch form each micro-batch; how a
micro-batch is then laid out (packed into one row, left-aligned rows, ...) is the engine's.
"""

from __future__ import annotations


def plan_micro_batches(lengths: list[int], budget: int, min_count: int = 1) -> list[list[int]]:
    """Group row indices into micro-batches of at most ``budget`` real tokens
    (first-fit decreasing; a row longer than the budget gets one of its own), then split
    the fullest groups until there are at least ``min_count`` (data-parallel ranks must run
    the same number of micro-batches). Groups may be empty when there are fewer rows than
    ``min_count``. Each group lists its rows in increasing order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for g, load in enumerate(loads):
            if load + lengths[i] <= budget:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    while len(groups) < min_count:
        splittable = [g for g in range(len(groups)) if len(groups[g]) > 1]
        if not splittable:
            groups.append([])
            loads.append(0)
            continue
        g = max(splittable, key=lambda k: loads[k])
        halves: tuple[list[int], list[int]] = ([], [])
        half_loads = [0, 0]
        for i in sorted(groups[g], key=lambda i: -lengths[i]):
            side = 0 if half_loads[0] <= half_loads[1] else 1
            halves[side].append(i)
            half_loads[side] += lengths[i]
        groups[g], loads[g] = halves[0], half_loads[0]
        groups.append(halves[1])
        loads.append(half_loads[1])
    return [sorted(g) for g in groups]
