"""What README.md and the pages under docs/ say is true. Every `python X.py ...` / `torchrun ... X.py ...` command
of their code blocks parses with the current flags (torchrun's own options with torchrun's parser); the quick-start
demo, the evaluation example and make-shards are run at tiny sizes and their output is compared, line by line with
the numbers masked, with the output the pages print; the README links every docs page, and every relative link of
these pages reaches a file (and a heading, for a link with an anchor)."""
from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from conftest import ROOT, cli_env, run_cli

import config
import flags
import evaluate
import export
import plots
import probe
import shards
import vae_trainer

README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
PARSERS = {"vae_trainer.py": flags.build_parser, "evaluate.py": evaluate.build_parser,
           "export.py": export.build_parser, "data.py": shards.build_parser,
           "probe.py": probe.build_parser, "plots.py": plots.build_parser}
# shell commands the pages' bash blocks may hold besides python/torchrun/pip (a docs page's preparation steps);
# anything else is a command this test does not understand, and fails
SHELL_TOOLS = ("mkdir", "cp", "for", "done", "cd", "export")


def pages() -> list[str]:
    """README.md and every docs/*.md: the files whose commands and links are checked."""
    return [README] + sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))


def name(path: str) -> str:
    return os.path.relpath(path, ROOT)


def code_blocks(path: str = README) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block of one page, indented ones (inside list items) included."""
    blocks, lines, lang, indent = [], None, "", 0
    for raw in open(path).read().splitlines():
        if raw.strip().startswith("```"):
            if lines is None:
                lang, lines, indent = raw.strip()[3:].strip(), [], len(raw) - len(raw.lstrip())
            else:
                blocks.append((lang, lines))
                lines = None
        elif lines is not None:
            lines.append(raw[indent:] if not raw[:indent].strip() else raw)
    assert lines is None, f"an unclosed code block in {name(path)}"
    return blocks


def all_code_blocks() -> list[tuple[str, str, list[str]]]:
    """(page, language, lines) of every fenced block of every page."""
    return [(path, lang, lines) for path in pages() for lang, lines in code_blocks(path)]


def join_continuations(lines: list[str]) -> list[str]:
    return "\n".join(lines).replace("\\\n", " ").splitlines()


def tokenize(line: str) -> list[list[str]]:
    """A shell line as its simple commands (split at ; && || | &), each a token list; comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, current = [], []
    for token in lexer:
        if token in (";", "&&", "||", "|", "&"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in commands + [current] if c]


def shell_commands() -> list[tuple[str, list[str]]]:
    """(page, tokens) of every command of the bash blocks (continuation lines joined, chains split, the block's
    own variables expanded: `C="..."` then `python X.py $C`, leading `VAR=value` and `nice` dropped) and of the
    `$ ` lines of the output blocks."""
    commands = []
    for path, lang, lines in all_code_blocks():
        if lang == "bash":
            variables = {}
            for line in join_continuations(lines):
                line = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), line)
                for tokens in tokenize(line):
                    assignments = 0
                    while assignments < len(tokens) and re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[assignments]):
                        assignments += 1
                    if assignments == len(tokens):  # `NAME=value` alone: a variable of this block
                        variables.update(t.split("=", 1) for t in tokens)
                        continue
                    tokens = tokens[assignments:]
                    while tokens and tokens[0] in ("nice", "do"):
                        tokens = tokens[1:]
                    if tokens and tokens[0] not in SHELL_TOOLS:
                        commands.append((path, tokens))
        elif lang == "":
            commands += [(path, tokenize(line[2:])[0]) for line in join_continuations(lines) if line.startswith("$ ")]
    return commands


def split_command(command: str | list[str]) -> tuple[list[str], str, list[str]]:
    """(launcher tokens, script, script args) of `python X.py ...` or `torchrun [options] X.py ...`; a `...`
    token (the pages' "and the rest as above") is dropped."""
    tokens = shlex.split(command, comments=True) if isinstance(command, str) else list(command)
    tokens = [t for t in tokens if t != "..."]
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
    assert script is not None and tokens[0] in ("python", "torchrun"), f"command not understood: {command}"
    return tokens[:script], tokens[script], tokens[script + 1:]


def mask(line: str) -> str:
    """A line with every number replaced by '#' (signs included): what stays is its shape."""
    shape = re.sub(r"[+-]?\d+(\.\d+)?(e[+-]?\d+)?", "#", line.rstrip())
    # the speed's two forms are one shape: a loaded machine's step of a second or more leads with its s/step
    return re.sub(r"# s/step \(# img/s(, avg #)?\)", lambda m: "# img/s" + (" (avg #)" if m.group(1) else ""), shape)


def assert_shows(expected: list[str], output: str, replace: dict[str, str] | None = None) -> None:
    """Every line a page shows has a line of the same shape in `output` (a `...` inside a line stands for
    any text; a line that is only `...` for lines left out). `replace` maps output text to what the page
    writes in its place (a temporary path to the page's)."""
    for old, new in (replace or {}).items():
        output = output.replace(old, new)
    actual = [mask(line) for line in output.splitlines()]
    for line in expected:
        if line.strip() in ("", "..."):
            continue
        pattern = ".*".join(re.escape(part) for part in mask(line).split("..."))
        assert any(re.fullmatch(pattern, a) for a in actual), f"documented line not in the output:\n{line}\n\n{output}"


def output_block(command_start: str) -> tuple[str, str, list[str]]:
    """(page, command, output lines) of the one `$ command` output block, on any page, whose command starts so."""
    found = [(path, lines[0][2:], lines[1:]) for path, lang, raw in all_code_blocks()
             for lines in [join_continuations(raw)]
             if lang == "" and lines and lines[0].startswith(f"$ {command_start}")]
    assert len(found) == 1, f"{len(found)} output blocks for `{command_start}`: {[name(p) for p, _, _ in found]}"
    return found[0]


def test_every_documented_command_parses():
    """Each script accepts every flag the README and the docs pages pass it (a renamed or removed flag fails here)."""
    from torch.distributed.run import get_args_parser
    seen = set()
    for path, tokens in shell_commands():
        command = f"{name(path)}: {shlex.join(tokens)}"
        if tokens[:2] == ["pip", "install"]:
            if "-r" in tokens:
                assert os.path.isfile(os.path.join(ROOT, tokens[tokens.index("-r") + 1])), command
            else:  # a package installed ahead of requirements.txt (torch's CPU build) must be one it names
                required = open(os.path.join(ROOT, "requirements.txt")).read()
                names = [t for t in tokens[2:] if not t.startswith("-") and not t.startswith("https://")]
                assert names and all(re.search(rf"^{n}\b", required, re.M) for n in names), command
            continue
        if tokens[:3] == ["python", "-m", "pytest"]:
            continue
        assert tokens[0] in ("python", "torchrun"), f"command not understood: {command}"
        launcher, script, args = split_command(tokens)
        try:
            if launcher[0] == "torchrun":
                get_args_parser().parse_args(launcher[1:] + [script])
            PARSERS[script]().parse_args(args)
        except (config.ConfigError, SystemExit) as e:
            raise AssertionError(f"documented command does not parse ({e}): {command}") from None
        seen.add(script)
    assert seen == set(PARSERS), seen  # the pages show every command


def test_the_test_command_is_the_readme_line_ci_runs():
    """.ci/run greps README.md for this line and runs it: it stays there, in this form."""
    lines = open(README).read().splitlines()
    assert any(re.match(r"pip install -r requirements\.txt && python -m pytest -q -n 2 tests(\s+#.*)?$", line)
               for line in lines)


GROUPED = """
import os, time, pytest

@pytest.fixture(scope="session")
def shared():
    with open(os.environ["BUILT"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "none") + "\\n")

@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("i", range(4))
def test_grouped(shared, i):
    time.sleep(0.3)

@pytest.mark.parametrize("i", range(4))
def test_free(i):
    time.sleep(0.3)
"""


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_tests_of_an_xdist_group_run_on_one_worker_and_build_their_fixture_once(tmp_path):
    """The README's test command (-n 2, pytest.ini's --dist loadgroup) with tests/conftest.py's collection hook: the
    tests of one xdist_group run on one worker, so the reference run they share is built once. With pytest 9 and
    xdist 3.8 xdist's own suffix no longer took effect: the group was dealt to both workers and its fixture built on
    each (the sharded runs: 2 x 100 s of the suite)."""
    import subprocess
    import sys
    project = os.path.join(ROOT, "tests", "conftest.py")
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('project_conftest', {project!r})\n"
        "project = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(project)\n"
        "pytest_collection_modifyitems = project.pytest_collection_modifyitems\n")
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    built = tmp_path / "built"
    result = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup", "-p",
                             "no:cacheprovider", "-c", os.path.join(ROOT, "pytest.ini"), "--rootdir", str(tmp_path),
                             str(tmp_path / "test_grouped.py")], cwd=tmp_path, capture_output=True, text=True,
                            env=cli_env(BUILT=str(built)), timeout=100)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    workers = set(re.findall(r"\[(gw\d)\] .*PASSED .*test_grouped\[", result.stdout))
    assert len(workers) == 1, result.stdout[-3000:]
    assert built.read_text().split() == [workers.pop()]


@pytest.mark.process
@pytest.mark.timeout(300)
def test_documented_examples_reproduce_their_output(tmp_path, photos_dir):
    """Run from a fresh directory as a new user would, without cached weights and without a network (the
    pages' outputs were made so): the README's demo (1 step instead of 300), then the evaluation example exactly
    as printed, then make-shards, wherever their blocks live."""
    home = tmp_path / "home"
    env = cli_env(HOME=home, CUDA_VISIBLE_DEVICES="", HTTPS_PROXY="http://127.0.0.1:9",
                  https_proxy="http://127.0.0.1:9")
    for key in ("TORCH_HOME", "XDG_CACHE_HOME"):
        env.pop(key, None)
    work = tmp_path / "work"
    work.mkdir()

    def run(command: str, *extra: str):
        _, script, args = split_command(command)
        proc = run_cli(script, args + list(extra), env=env, cwd=str(work), timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    # the quick start: the demo, shortened; its lines have the README's shape
    page, command, shown = output_block("python vae_trainer.py --demo")
    assert page == README  # the first thing a new user runs, and what it prints
    proc = run(command, "--max_steps", "1", "--log_every_n_steps", "1", "--save_every_n_steps", "1",
               "--evaluate_every_n_steps", "1")
    assert_shows(shown, proc.stdout + proc.stderr, {str(home): "~"})
    sample_lines = [(path, lines) for path, lang, lines in all_code_blocks() if lang == "" and lines[0].startswith("step ")]
    assert [path for path, _ in sample_lines] == [README]  # "Rank 0 prints a line every --log_every_n_steps"
    assert_shows(sample_lines[0][1], proc.stdout)

    # the evaluation example, as printed: the same keys, nulls where the page has nulls
    _, command, shown = output_block("python evaluate.py")
    proc = run(command)
    expected, actual = json.loads(shown[0]), json.loads(proc.stdout)
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert type(actual[key]) is type(value), (key, actual[key], value)
        if isinstance(value, str):
            assert mask(actual[key]) == mask(value), key
    assert (work / "eval" / "metrics.json").is_file() and (work / "eval" / "reconstructions.png").is_file()

    # make-shards with the output its comment lines show (the one such block; others only parse above)
    (_, lines), = [(path, lines) for path, _, lines in all_code_blocks()
                   if lines[0].startswith("python data.py make-shards") and any(l.startswith("# ") for l in lines[1:])]
    command = lines[0].replace("/data/my_photos", photos_dir).replace("/data/shards", str(tmp_path / "shards"))
    proc = run(command, "--shard_size", "3")  # 8 photos: 3 shards, as the page's brace range
    assert_shows([line[2:] for line in lines[1:] if line.startswith("# ")], proc.stdout,
                 {str(tmp_path / "shards"): "/data/shards"})


def test_the_readme_links_every_docs_page():
    """The README is the path a new user follows (what it is, the two commands, the demo, a recipe per kind of
    user, the tour of the code); everything else lives in a docs page it links."""
    linked = {os.path.normpath(os.path.join(ROOT, target.split("#")[0])) for _, target in links(README)}
    unlinked = [name(path) for path in pages()[1:] if path not in linked]
    assert unlinked == [], f"docs pages the README does not link: {unlinked}"


def prose(path: str, code_spans: bool = False) -> list[str]:
    """A page's lines outside its fenced code blocks (as blank lines, so line numbers stay), with inline code
    spans removed unless `code_spans`."""
    out, fenced = [], False
    for line in open(path).read().splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line if code_spans else re.sub(r"`[^`]*`", "", line))
    return out


def links(path: str) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link and image of a page's prose."""
    return [(i, m.group(1)) for i, line in enumerate(prose(path), 1)
            for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", line)]


def anchors(path: str) -> set[str]:
    """The anchors GitHub gives a page's headings: the heading text (links reduced to their text) lower-cased,
    punctuation other than - and _ dropped, spaces as -, a repeated one suffixed -1, -2, ..."""
    found, counts = set(), {}
    for line in prose(path, code_spans=True):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
            slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_every_relative_link_reaches_a_file_and_heading():
    """Every link of the README and the docs pages that is not a URL points to a file of the repository, and
    its #anchor, if any, to a heading of that file (moved sections break here, not in a reader's browser)."""
    broken = []
    for path in pages():
        for line, target in links(path):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(resolved):
                broken.append(f"{name(path)}:{line}: {target} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"{name(path)}:{line}: {target} (no such heading in {name(resolved)})")
    assert broken == [], "\n".join(broken)


def test_anchors_follow_github(tmp_path):
    """The slug rule the link test relies on, on headings of these pages' kinds."""
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "# Flags", "## 3b. Decoder-only fine-tuning", "## The frozen-trunk critic (`--critic_trunk frozen`, issue 19)",
        "#### Fine-tuning a released VAE ([how](finetuning.md))", "## Flags", "```", "# not a heading", "```"]))
    assert anchors(str(page)) == {"flags", "3b-decoder-only-fine-tuning",
                                  "the-frozen-trunk-critic---critic_trunk-frozen-issue-19",
                                  "fine-tuning-a-released-vae-how", "flags-1"}


def layout_table() -> dict[str, int]:
    """docs/extending.md's Layout table: {module (bench/ for the package) -> its layer}."""
    text = open(os.path.join(DOCS, "extending.md")).read()
    section = text[text.index("## Layout"):text.index("## Where a new piece plugs in")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[1][:1].isdigit():
            continue
        assert len(cells) == 3, f"a Layout row has file | layer | its one job, no line count: {line}"
        for file in re.findall(r"`([\w/]+(?:\.py)?)`", cells[0]):
            rows[file[:-3] if file.endswith(".py") else file] = int(cells[1].split()[0])
    return rows


def module_imports(paths: list[str], modules: set[str]) -> set[str]:
    """The project's modules that these files import (imports inside functions count too)."""
    import ast
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found & modules


def test_the_layout_keeps_its_promises():
    """docs/extending.md's Layout table is the layout (issue 32 item 6): a row for every module and the bench
    package, and the README's tour names each of them; no import runs up a layer or in a circle; nothing but
    bench imports the trainer. No line counts (issue 49): a file is as long as its one job."""
    modules = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    package = sorted(os.path.join(ROOT, "bench", f) for f in os.listdir(os.path.join(ROOT, "bench"))
                     if f.endswith(".py"))
    imports = {m: module_imports([os.path.join(ROOT, m + ".py")], modules) - {m} for m in modules}
    imports["bench"] = module_imports(package, modules) - {"bench"}  # bench.py launches the package: one unit
    table = layout_table()
    assert set(table) == modules | {"bench/"}, f"rows to add or remove: {sorted(set(table) ^ (modules | {'bench/'}))}"
    layer = {m: table[m] for m in modules}
    upward = [(m, i, layer[i]) for m in modules for i in imports[m] if layer[i] > layer[m]]
    assert upward == [], f"imports that run up a layer (module, import, its layer): {upward}"

    def reaches(start, target, seen=()):
        return any(m == target or (m not in seen and reaches(m, target, seen + (m,))) for m in imports[start])
    assert [m for m in sorted(modules) if reaches(m, m)] == []
    assert [m for m in modules if "vae_trainer" in imports[m]] == ["bench"]
    readme = open(README).read()
    tour = readme[readme.index("## A tour of the code"):readme.index("Where a new piece plugs in")]
    assert [m for m in sorted(modules) if f"`{m}.py`" not in tour] == [] and "`bench/`" in tour
    names = open(os.path.join(ROOT, "bench", "__init__.py")).read()
    names = names[:names.index('"""', 3)]
    unlisted = [os.path.basename(p)[:-3] for p in package if not p.endswith("__init__.py")
                and not re.search(rf"\b{os.path.basename(p)[:-3]}\b", names)]
    assert unlisted == [], f"bench/__init__.py's docstring does not name {unlisted}"
