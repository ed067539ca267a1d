"""The fenced shell blocks of docs/deploy.md and the doc-test marker each carries."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

DOC = REPO / "docs" / "deploy.md"
MARKER = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->")


@dataclass
class Block:
    """One fenced shell block of the page and how the page says to run it."""

    line: int  # 1-based line of the opening fence
    text: str
    kind: str = "run"
    args: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{DOC.name}:{self.line} ({self.kind} {' '.join(self.args)})".rstrip()


def shell_blocks(text: str) -> list[Block]:
    """The ``bash``/``sh`` blocks of ``text`` with their doc-test markers (a marker must be
    on the line right before the fence)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w*)\s*", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{DOC.name}:{i + 1}: unclosed code fence")
        if fence.group(1) in ("bash", "sh", "shell", "console"):
            block = Block(i + 1, "\n".join(lines[i + 1:end]) + "\n")
            marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
            if marker:
                spec = marker.group(1)
                kind, _, rest = spec.partition(":") if spec.split()[0].rstrip(":") in (
                    "skip", "external") else (spec.split()[0], "", " ".join(spec.split()[1:]))
                block.kind = kind.strip()
                block.args = [rest.strip()] if block.kind in ("skip", "external") else rest.split()
            blocks.append(block)
        i = end + 1
    return blocks
