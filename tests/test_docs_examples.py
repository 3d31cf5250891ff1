"""Every example in README.md and docs/*.md runs as written, and shows what it really prints (issue #34).

Each fenced ```python and ```bash block of a page is one test (its id names the page and the block's first line).
Blocks without a language tag (or tagged ``text``) are output listings, not examples. HTML comments on the lines
just above a block's fence steer it:

* ``<!-- not run: REASON -->``: the block cannot run here (a cluster's scheduler, an install); the test skips
  with the reason, so the report lists every such block.
* ``<!-- continues -->``: a python block that continues the page's previous python block (that block, and what
  it continues, run first, in one script); ``<!-- continues: #ANCHOR -->`` continues the first python block under
  the page's heading ``ANCHOR`` (GitHub's anchor of the heading) instead.
* ``<!-- file: PATH -->``: the block is a file the page's commands use (``my_check.py``, a test file); it is
  written to ``PATH`` in the working folder of every block of the page and run by those commands.
* ``<!-- tested as: FROM => TO; REASON -->``: a bash block whose commands run with the text ``FROM`` replaced by
  ``TO`` (a smaller size of the same command: the same flags and code path, minutes less of compiling); the
  test names the substitution and its reason, ``FROM`` must occur in the block, and no output listing may show
  what such a command prints (its numbers would be the page's command's, not the smaller one's).
* ``<!-- output of: COMMAND -->`` above an output listing (or a listing whose first line is ``$ COMMAND``): the
  listing is what ``COMMAND`` prints. Every number the listing shows must appear in the command's output, except
  on lines that report a time or a process id, which differ from run to run, and on ``train``'s ``max drift``
  line, whose drift between two runs is the accumulated rounding of their reductions and changes with the CPU's
  vector width (an AVX-512 machine gave 0.00585 where the page's gave 0.0078, both far within 0.064). A listing marked ``not run`` (the
  output of another machine) is not checked.

Python blocks run in a subprocess with 8 fake CPU devices (``JAX_NUM_CPU_DEVICES=8``, read before JAX starts;
a block that sets ``jax_num_cpu_devices`` itself wins); a block that defines ``test_*`` functions is a pytest file
and runs under pytest. A top-level expression statement whose comment starts with a literal (``x  # 7.5 (...)``,
``report.reference  # 'gspmd on data=2,model=4'``) is checked against it (numbers within 1e-5 relative).

Bash blocks run line by line through ``bash -c`` (a ``\\`` continues a line). A line's comment ``# exit N`` is
the exit status it must end with (0 otherwise); ``# 2 passed, 1 skipped`` is a pytest summary its output must
contain (with a failure in it, exit status 1). A command that an earlier block (in page order: README.md, then docs/*.md by name) already runs, with
the same text, is not run twice: the test names the block that runs it.

Every block runs in a fresh temporary folder holding a copy of ``examples/`` (commands write ``run.npz``,
``loss.png``, ... there, never into the repository), with the command line's compilation cache in the test
session's cache folder (``SHARDCHECK_COMPILATION_CACHE``, shared with the other tests; off when the session's is
off), JAX's own persistent cache in that folder for python blocks and pytest runs (``JAX_COMPILATION_CACHE_DIR``:
a chained block runs the blocks it continues again, and loads their programs instead of compiling them), and a
timeout.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_OPENING_LINE = 4  # the first code line of the README's first block, right under its title
TIMEOUT_S = 600  # each command or script of a block
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*(not run|continues|file|output of|tested as)\s*(?::\s*(.*?))?\s*-->$")
TESTED_AS = re.compile(r"^(.+?)\s+=>\s+(.+?);\s*(\S.*)$")


OPENING = (
    "the README's two opening commands install the package and run the whole test suite: .ci/run runs them"
)
"""Why the README's first block is not run here (the page opens with it, with no marker above it)."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language tag (``""`` for none), first code line (1-based) and text."""

    page: str  # relative to the repository root
    line: int
    lang: str
    code: str
    heading: str  # the anchor of the section the block is in
    markers: tuple[tuple[str, str], ...]  # (kind, argument) of the HTML comments just above the fence

    def marker(self, kind: str) -> str | None:
        if kind == "not run" and self.opens_the_readme:
            return OPENING
        return next((arg for k, arg in self.markers if k == kind), None)

    def tested_as(self) -> tuple[str, str, str] | None:
        """``(FROM, TO, REASON)`` of the block's ``<!-- tested as: FROM => TO; REASON -->``, or None."""
        text = self.marker("tested as")
        if text is None:
            return None
        match = TESTED_AS.match(text)
        assert match, (
            f"{self.where}: <!-- tested as: {text} --> is not <!-- tested as: FROM => TO; REASON -->"
        )
        return match.group(1), match.group(2), match.group(3)

    @property
    def opens_the_readme(self) -> bool:
        """The README's first block, its two commands (install and main job; install and the test suite)."""
        return self.page == "README.md" and self.line == README_OPENING_LINE

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return "#" + text.replace(" ", "-")


def page_blocks(path: Path) -> list[Block]:
    """The fenced blocks of one page, with the markers above each."""
    lines = path.read_text().splitlines()
    blocks, heading, i = [], "#", 0
    while i < len(lines):
        if lines[i].startswith("#") and not lines[i].startswith("#!"):
            heading = anchor(lines[i].lstrip("#"))
        fence = FENCE.match(lines[i].strip())
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        indent = len(lines[i]) - len(lines[i].lstrip())
        markers, k = [], i - 1
        while k >= 0 and (m := MARKER.match(lines[k].strip())):
            markers.insert(0, (m.group(1), m.group(2) or ""))
            k -= 1
        code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        blocks.append(
            Block(str(path.relative_to(ROOT)), i + 2, fence.group(1), code, heading, tuple(markers))
        )
        i = end + 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in page_blocks(page)]
EXAMPLES = [b for b in ALL_BLOCKS if b.lang in ("python", "bash")]


# ------------------------------------------------------------------------------------------------- bash commands


@dataclasses.dataclass(frozen=True)
class Command:
    """One command line of a bash block, with what its comment says it must do."""

    text: str  # as bash runs it, comment dropped
    exit_status: int
    summary: str | None  # a pytest summary the output must contain ("2 passed, 1 skipped")


def split_comment(line: str) -> tuple[str, str]:
    """``(command, comment)``: the comment is the text after the first ``#`` outside quotes and words."""
    quote, prev = None, " "
    for pos, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and prev.isspace():
            return line[:pos].rstrip(), line[pos + 1 :].strip()
        prev = char
    return line.rstrip(), ""


def commands(block: Block) -> list[Command]:
    """The commands of a bash block, continuation lines joined."""
    out, pending = [], ""
    for raw in block.code.splitlines():
        if not pending and (not raw.strip() or raw.lstrip().startswith("#")):
            continue  # blank lines, comment lines, a shebang
        text, comment = split_comment(raw)
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        text, pending = pending + text.strip(), ""
        status = re.match(r"exit (\d+)", comment)
        summary = re.match(
            r"(\d+ (?:passed|failed|skipped|error)(?:, \d+ (?:passed|failed|skipped|error))*)", comment
        )
        summary = summary.group(1) if summary else None
        default = 1 if summary and re.search(r"\b[1-9]\d* (?:failed|error)", summary) else 0  # pytest's rule
        out.append(Command(text, int(status.group(1)) if status else default, summary))
    return out


def pytest_counts(summary: str) -> dict[str, int]:
    """``{"passed": 2, "skipped": 1}`` from a pytest summary line, in any order."""
    return {outcome: int(n) for n, outcome in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}


def normalized(command: str) -> str:
    return " ".join(command.split())


def first_runs() -> dict[str, str]:
    """Each command's text -> the block (``page:line``) that runs it: the first, in page order, not marked."""
    runs: dict[str, str] = {}
    for block in EXAMPLES:
        if block.lang == "bash" and block.marker("not run") is None:
            for command in commands(block):
                runs.setdefault(normalized(command.text), block.where)
    return runs


FIRST_RUNS = first_runs()


# ------------------------------------------------------------------------------------------------ output listings

NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?")
NOT_REPRODUCIBLE = re.compile(r"^\s*(time\b|launch:|max drift\b)|\bpid \d+|\d+(?:\.\d+)? s\b")


def listings() -> dict[str, list[Block]]:
    """Command text -> the output listings that show what it prints."""
    out: dict[str, list[Block]] = {}
    for block in ALL_BLOCKS:
        if block.lang not in ("", "text") or block.marker("not run") is not None:
            continue
        command = block.marker("output of")
        if command is None and block.code.startswith("$ "):
            command = split_comment(block.code.splitlines()[0][2:])[0]
        if command:
            out.setdefault(normalized(command), []).append(block)
    return out


LISTINGS = listings()


def listing_numbers(listing: Block) -> list[str]:
    """The numbers a listing shows, but those of its lines that hold a time or a pid."""
    lines = listing.code.splitlines()
    if listing.code.startswith("$ "):
        lines = lines[1:]
    return [n for line in lines if not NOT_REPRODUCIBLE.search(line) for n in NUMBER.findall(line)]


def check_listings(command: str, output: str, listings: dict[str, list[Block]] = LISTINGS) -> None:
    """Every number of every listing of ``command`` appears in its ``output``."""
    printed = set(NUMBER.findall(output))
    for listing in listings.get(normalized(command), []):
        missing = [n for n in listing_numbers(listing) if n not in printed]
        assert not missing, (
            f"{listing.where}: the listing shows {missing}, which `{command}` does not print; it printed:\n{output}"
        )


# ----------------------------------------------------------------------------------------------------- running


def environment(tmp_path: Path) -> dict[str, str]:
    """The environment of a block: this Python's scripts first on PATH, the session's compilation cache."""
    # a user's shell: no pytest or CI variables (under CI=true the plugin fails where the page's pytest skips)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "JAX_NUM_CPU")) and k != "CI"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    session = os.environ.get("SHARDCHECK_TEST_XLA_CACHE", "off")
    env["SHARDCHECK_COMPILATION_CACHE"] = session  # a folder, or "off"
    if session != "off":  # python blocks and pytest runs too: what a block compiled loads in the next one
        env["JAX_COMPILATION_CACHE_DIR"] = session
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["COLUMNS"] = "200"  # rich's tables as a terminal shows them (a pipe's width is 80)
    env["MPLBACKEND"] = "Agg"
    env.pop("PYTHONPATH", None)
    return env


def workdir(tmp_path: Path, block: Block) -> Path:
    """A fresh working folder: a copy of examples/, and the page's ``file:`` blocks written out."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    for other in ALL_BLOCKS:
        if other.page == block.page and (name := other.marker("file")):
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(other.code)
    return tmp_path


def run(argv: list[str], cwd: Path, env: dict[str, str], what: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{what} ran past {TIMEOUT_S} s; its output:\n{err.stdout}\n{err.stderr}")


def literal_comment(comment: str):
    """The literal a comment starts with (``7.5 (shard losses ...)`` -> 7.5), or None."""
    match = re.match(
        r"""(-?[\d.]+(?:e[-+]?\d+)?|'[^']*'|"[^"]*"|\[[\[\]\d.,\s-]*\])(?=$|[\s,;:)])""", comment
    )
    if not match:
        return None
    try:
        return ast.literal_eval(match.group(1))
    except (ValueError, SyntaxError):
        return None


CHECK = """
def __doc_check(value, shown, where):
    import numpy as np
    if isinstance(shown, str):
        assert str(value) == shown, f"{where}: the page shows {shown!r}, the code gives {value!r}"
    else:
        got = np.asarray(value, dtype=np.float64)
        assert got.shape == np.shape(shown) and np.allclose(got, shown, rtol=1e-5, atol=0), (
            f"{where}: the page shows {shown!r}, the code gives {got!r}"
        )
"""


def with_value_checks(code: str, block: Block) -> str:
    """``code`` with each top-level expression whose comment starts with a literal turned into a check of it.

    Lines keep their places (a check takes the expression's first line, the rest stay blank).
    """
    comments = {
        tok.start[0]: tok.string[1:].strip()
        for tok in tokenize.generate_tokens(io.StringIO(code).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = code.splitlines()
    for node in ast.parse(code).body:
        if not isinstance(node, ast.Expr) or isinstance(node.value, ast.Constant):
            continue
        shown = literal_comment(comments.get(node.end_lineno, ""))
        if shown is None:
            continue
        expr = " ".join(ast.get_source_segment(code, node.value).split())
        where = f"{block.page}:{block.line + node.lineno - 1}"
        lines[node.lineno - 1] = f"__doc_check(({expr}), {shown!r}, {where!r})"
        for k in range(node.lineno, node.end_lineno):
            lines[k] = ""
    return "\n".join(lines) + "\n"


def chain(block: Block) -> list[Block]:
    """The python blocks that run as one script ending with ``block``: what it continues, then itself."""
    target = block.marker("continues")
    if target is None:
        return [block]
    earlier = [b for b in EXAMPLES if b.page == block.page and b.lang == "python" and b.line < block.line]
    if target:
        found = [b for b in earlier if b.heading == target]
        assert found, (
            f"{block.where}: <!-- continues: {target} --> names no section with a python block before it"
        )
        return [*chain(found[0]), block]
    assert earlier, f"{block.where}: <!-- continues --> but no python block comes before it on the page"
    return [*chain(earlier[-1]), block]


def run_python(block: Block, tmp_path: Path) -> None:
    parts = chain(block)
    script = CHECK + "".join(with_value_checks(part.code, part) for part in parts)
    cwd, env = workdir(tmp_path, block), environment(tmp_path)
    env["JAX_NUM_CPU_DEVICES"] = "8"
    is_test_file = re.search(r"^def test_\w*\(", block.code, re.MULTILINE) is not None
    name = "test_doc_block.py" if is_test_file else "doc_block.py"
    (cwd / name).write_text(script)
    argv = (
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name]
        if is_test_file
        else [sys.executable, name]
    )
    done = run(argv, cwd, env, block.where)
    chained = " after " + ", ".join(p.where for p in parts[:-1]) if len(parts) > 1 else ""
    assert done.returncode == 0, (
        f"{block.where}{chained} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    if is_test_file:
        assert re.search(r"\b\d+ passed\b", done.stdout) and "failed" not in done.stdout, done.stdout


def as_tested(block: Block, command: str) -> str:
    """``command`` as the block's ``<!-- tested as: FROM => TO; REASON -->`` runs it (itself without one)."""
    substitution = block.tested_as()
    if substitution is None or substitution[0] not in command:
        return command
    assert normalized(command) not in LISTINGS, (
        f"{block.where}: a listing shows what `{command}` prints, but the block runs it as <!-- tested as -->"
    )
    text = command.replace(substitution[0], substitution[1])
    print(f"{block.where}: `{command}` runs as `{text}`: {substitution[2]}")
    return text


def run_bash(block: Block, tmp_path: Path) -> list[str]:
    """Runs the block's commands in order; returns those left to the block that runs them first."""
    cwd, env = workdir(tmp_path, block), environment(tmp_path)
    elsewhere = []
    if substitution := block.tested_as():
        assert any(substitution[0] in c.text for c in commands(block)), (
            f"{block.where}: <!-- tested as --> replaces {substitution[0]!r}, which no command of the block has"
        )
    for command in commands(block):
        runner = FIRST_RUNS[normalized(command.text)]
        if runner != block.where:
            elsewhere.append(f"`{command.text}` runs in {runner}")
            continue
        text = as_tested(block, command.text)
        done = run(["bash", "-c", text], cwd, env, f"{block.where}: {text}")
        output = done.stdout + done.stderr
        assert done.returncode == command.exit_status, (
            f"{block.where}: `{text}` exited {done.returncode}, the page says {command.exit_status}:\n{output}"
        )
        if command.summary:
            assert pytest_counts(command.summary) == pytest_counts(done.stdout.strip().splitlines()[-1]), (
                f"{block.where}: `{command.text}` did not end with {command.summary!r}:\n{output}"
            )
        check_listings(command.text, output)
    return elsewhere


# ------------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("block", EXAMPLES, ids=[f"{b.page}:{b.line}-{b.lang}" for b in EXAMPLES])
def test_example_runs_as_written(block: Block, tmp_path):
    if (reason := block.marker("not run")) is not None:
        assert reason, f"{block.where}: <!-- not run --> must give its reason: <!-- not run: REASON -->"
        pytest.skip(f"not run: {reason}")
    if (name := block.marker("file")) is not None:
        users = [
            b.where
            for b in EXAMPLES
            if b.page == block.page
            and b is not block
            and b.marker("not run") is None
            and Path(name).name in b.code
        ]
        assert users, f"{block.where}: file {name} is used by no example on {block.page}"
        return  # the commands that use it run it
    if block.lang == "python":
        run_python(block, tmp_path)
    else:
        run_bash(block, tmp_path)


UNRUN_LISTINGS = [c for c in LISTINGS if c not in FIRST_RUNS]


@pytest.mark.parametrize("command", UNRUN_LISTINGS, ids=[LISTINGS[c][0].where for c in UNRUN_LISTINGS])
def test_listing_shows_what_its_command_prints(command, tmp_path):
    """A listing whose command no bash block runs: run it here."""
    cwd, env = workdir(tmp_path, LISTINGS[command][0]), environment(tmp_path)
    done = run(["bash", "-c", command], cwd, env, command)
    assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    check_listings(command, done.stdout + done.stderr)


# ------------------------------------------------------------------------------------------ the extractor itself


def test_the_extractor_finds_every_page_and_its_markers():
    pages = {b.page for b in EXAMPLES}
    assert {"README.md", "docs/parity.md", "docs/distributed.md", "docs/testing.md", "docs/train.md"} <= pages
    assert sum(b.lang == "python" for b in EXAMPLES) >= 14 and sum(b.lang == "bash" for b in EXAMPLES) >= 17
    for block in ALL_BLOCKS:
        for kind, arg in block.markers:
            assert kind != "file" or arg, f"{block.where}: <!-- file: PATH --> needs its PATH"


def test_comments_give_exit_statuses_summaries_and_values():
    block = Block(
        "x.md",
        1,
        "bash",
        "a --x 1 \\\n    --y 2   # exit 1: the diagnosis\nb   # 2 passed, 1 skipped (why)\nCI=1 c  # 2 passed, 1 failed\n",
        "#",
        (),
    )
    assert commands(block) == [
        Command("a --x 1 --y 2", 1, None),
        Command("b", 0, "2 passed, 1 skipped"),
        Command("CI=1 c", 1, "2 passed, 1 failed"),  # a pytest run with a failure exits 1
    ]
    assert split_comment("echo '#x' a#b  # c") == ("echo '#x' a#b", "c")
    assert pytest_counts("=== 1 failed, 2 passed in 31.58s ===") == pytest_counts("2 passed, 1 failed")
    assert literal_comment("7.5 (shard losses 2.5, 12.5)") == 7.5
    assert literal_comment("95204, nothing allocated") == 95204
    assert literal_comment("[[8., 12.]]") == [[8.0, 12.0]]
    assert literal_comment("'gspmd on data=2,model=4'") == "gspmd on data=2,model=4"
    assert literal_comment("(S,) losses, stacked (S, ...) grads") is None
    assert literal_comment("the baseline step") is None
    assert anchor(" Check your own step") == "#check-your-own-step"
    assert anchor(" Memory per device, before it runs") == "#memory-per-device-before-it-runs"


def test_a_tested_as_marker_gives_the_substitution_and_its_reason():
    marker = ("tested as", "--size 1b => --size tiny; the same flags at the default size")
    block = Block("x.md", 3, "bash", "a --size 1b --mesh fsdp=64\n", "#", (marker,))
    assert block.tested_as() == ("--size 1b", "--size tiny", "the same flags at the default size")
    assert Block("x.md", 3, "bash", "a\n", "#", ()).tested_as() is None
    bad = Block("x.md", 3, "bash", "a --size 1b\n", "#", (("tested as", "--size 1b --size tiny"),))
    with pytest.raises(AssertionError, match=r"x\.md:3: <!-- tested as: --size 1b --size tiny --> is not"):
        bad.tested_as()


def test_a_value_the_code_does_not_give_fails_its_block():
    block = Block("x.md", 10, "python", "x = 2\nx + 1  # 3\nx * 2  # 5.0 (a wrong value)\n", "#", ())
    script = CHECK + with_value_checks(block.code, block)
    with pytest.raises(AssertionError, match=r"x\.md:12: the page shows 5\.0, the code gives array\(4\.\)"):
        exec(script, {})
    right = Block(
        "x.md", 10, "python", "x = 'a'\nx  # 'a'\n[x] * 2  # two of them: no literal, not checked\n", "#", ()
    )
    exec(CHECK + with_value_checks(right.code, right), {})


def test_a_listing_number_the_command_does_not_print_fails():
    listing = Block(
        "x.md",
        5,
        "",
        "loss 0.45418 drift 5.96e-08\ntime 2.2 s\nlaunch: process 0 (pid 4242) exited\n",
        "#",
        (),
    )
    listings = {"cmd --x": [listing]}
    check_listings("cmd  --x", "loss 0.45418, drift 5.96e-08 in 9.1 s", listings)  # times and pids differ
    with pytest.raises(AssertionError, match=r"x\.md:5: the listing shows \['5\.96e-08'\]"):
        check_listings("cmd --x", "loss 0.45418, drift 6e-08", listings)


def test_the_readme_opens_with_its_two_commands():
    """The README's first block is the install-and-run and install-and-test pair, skipped here by rule."""
    first = next(b for b in EXAMPLES if b.page == "README.md")
    assert first.line == README_OPENING_LINE and first.lang == "bash"
    assert first.code.splitlines() == [
        "python -m pip install -e . && shardcheck run",
        'python -m pip install -e ".[test]" && python -m pytest',
    ]
    assert first.marker("not run") == OPENING
