"""The one thing every control policy returns: an action and the reason for it, in words.

Policies never act. They see observations and return a `Decision`; the runtime applies it and logs
`str(decision)`, e.g. "disable: live AL 1.12 < 1.19 = (1 - 0.05) x break-even 1.25 at batch 4.0".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

A = TypeVar("A", bound=Enum)


@dataclass(frozen=True)
class Decision(Generic[A]):
    """`action` is the policy's own enum; `version` is the draft version it concerns, if any
    (DEPLOY: the new draft, ROLLBACK: the draft to go back to, CONFIRM: the draft confirmed)."""

    action: A
    reason: str
    version: int | None = None

    def __str__(self) -> str:
        tag = f" v{self.version}" if self.version is not None else ""
        return f"{self.action.value}{tag}: {self.reason}"


