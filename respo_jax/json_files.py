"""One JSON file read with an error naming the file and line (`path:line: problem`).

Why a leaf module: the run files (`respo_jax.runs`) and the model's checkpoint files (`config.json`, the
safetensors index, in `respo_jax.models.qwen3`) need the same reader, and the models import nothing
above them.
"""

from __future__ import annotations

import json
import os
from typing import Any


class JsonFileError(ValueError):
    """A file that cannot be read: `path`, `line` (1-based, None for a whole file) and `problem`."""

    def __init__(self, path: str, problem: str, line: int | None = None):
        self.path, self.problem, self.line = path, problem, line
        super().__init__(f"{self.where}: {problem}")

    @property
    def where(self) -> str:
        return self.path if self.line is None else f"{self.path}:{self.line}"


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value in `path`; JsonFileError naming the line of a bad UTF-8 byte or a syntax error."""
    path = os.fspath(path)
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise JsonFileError(path, f"invalid UTF-8 byte {data[err.start]:#04x}", line) from None
    except json.JSONDecodeError as err:
        raise JsonFileError(path, f"invalid JSON ({err.msg})", err.lineno) from None
