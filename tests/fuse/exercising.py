"""What the two exercisers share: operations picked at random by weight, and the
last ones done, which explain a failure."""

from __future__ import annotations

import collections
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

# An operation's name -> (its weight, the operation).
Operations: TypeAlias = dict[str, tuple[int, Callable[[], None]]]


def run_at_random(
    rng: random.Random, operations: Operations, ops: int, counts: collections.Counter[str]
) -> None:
    """Run ops operations, each picked by weight; counts counts each by name."""
    names = list(operations)
    weights = [operations[name][0] for name in names]
    for _ in range(ops):
        name = rng.choices(names, weights)[0]
        counts[name] += 1
        operations[name][1]()


@dataclass
class Recent:
    """The last operations, each as one line."""

    lines: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=40))

    def note(self, line: str) -> None:
        self.lines.append(line)

    def __str__(self) -> str:
        return "last operations:\n  " + "\n  ".join(self.lines)
