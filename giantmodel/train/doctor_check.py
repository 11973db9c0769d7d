"""One line of ``giantmodel doctor``'s report (shared by its local and
distributed parts)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Check:
    name: str
    status: str  # "ok" | "info" | "warn" | "fail"
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f" -> fix: {self.fix}" if self.fix and self.status in ("warn", "fail") else ""
        tag = "FAIL" if self.status == "fail" else self.status
        return f"  {tag:<5} {self.name:<18} {self.detail}{fix}"
