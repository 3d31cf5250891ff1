"""No function of the package is longer than :data:`LIMIT` lines of code, read from the source with ``ast``.

A line of code is a non-blank line of the function, signature included, that is neither a comment nor part of its
docstring. A function that outgrows the limit does several things; split it where its steps are.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "shardcheck"
LIMIT = 60


def _docstring(node) -> range:
    first = node.body[0] if node.body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return range(first.lineno, first.end_lineno + 1)
    return range(0)


def code_lines(source: str) -> dict[str, int]:
    """``{"name:line": lines of code}`` of every function and method in ``source``."""
    text = source.splitlines()
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = _docstring(node)
            lines = [
                i
                for i in range(node.lineno, node.end_lineno + 1)
                if i not in doc and text[i - 1].strip() and not text[i - 1].strip().startswith("#")
            ]
            out[f"{node.name}:{node.lineno}"] = len(lines)
    return out


def test_no_function_is_longer_than_the_limit():
    long = {
        f"{path.relative_to(SRC)}:{name}": n
        for path in sorted(SRC.rglob("*.py"))
        for name, n in code_lines(path.read_text()).items()
        if n > LIMIT
    }
    assert not long, f"functions over {LIMIT} lines of code: {long}"


def test_the_count_skips_docstrings_comments_and_blank_lines():
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    source = f'def f():\n    """Doc.\n\n    More.\n    """\n    # a comment\n\n{body}\n'
    assert code_lines(source) == {"f:1": LIMIT + 1}  # the signature and LIMIT statements: one too many
