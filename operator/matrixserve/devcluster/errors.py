"""One error type for the dev cluster, carrying the failed step, its log and what to do."""

from __future__ import annotations

from pathlib import Path


def tail(path: Path | None, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file, or an empty string if there is none."""
    if path is None or not path.exists():
        return ""
    with path.open("rb") as handle:
        handle.seek(0, 2)
        size = handle.tell()
        handle.seek(max(0, size - 64 * 1024))
        text = handle.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


class DevClusterError(RuntimeError):
    """A dev-cluster step failed. ``str()`` says which step, shows its log tail and a hint."""

    def __init__(
        self, step: str, message: str, *, log: Path | None = None, hint: str | None = None
    ) -> None:
        self.step = step
        self.message = message
        self.log = log
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        parts = [f"devcluster: step '{self.step}' failed: {self.message}"]
        if self.log is not None:
            parts.append(f"  log: {self.log}")
            excerpt = tail(self.log)
            if excerpt:
                parts.append(
                    "  last lines:\n" + "\n".join("    " + x for x in excerpt.splitlines())
                )
        if self.hint:
            parts.append(f"  what to do: {self.hint}")
        return "\n".join(parts)
