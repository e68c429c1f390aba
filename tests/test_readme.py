"""README.md's commands do what it shows. Every `python X.py ...` / `torchrun ... X.py ...` command of its code
blocks parses with the current flags (torchrun's own options with torchrun's parser); the quick-start demo,
the evaluation example and make-shards are run at tiny sizes and their output is compared, line by line with
the numbers masked, with the output the README prints."""
from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from conftest import ROOT, cli_env, run_cli

import data
import evaluate
import export
import plots
import probe
import vae_trainer
import config

README = os.path.join(ROOT, "README.md")
PARSERS = {"vae_trainer.py": config.build_parser, "evaluate.py": evaluate.build_parser,
           "export.py": export.build_parser, "data.py": data.build_parser,
           "probe.py": probe.build_parser, "plots.py": plots.build_parser}


def code_blocks() -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block, indented ones (inside list items) included."""
    blocks, lines, lang, indent = [], None, "", 0
    for raw in open(README).read().splitlines():
        if raw.strip().startswith("```"):
            if lines is None:
                lang, lines, indent = raw.strip()[3:].strip(), [], len(raw) - len(raw.lstrip())
            else:
                blocks.append((lang, lines))
                lines = None
        elif lines is not None:
            lines.append(raw[indent:] if not raw[:indent].strip() else raw)
    assert lines is None, "an unclosed code block"
    return blocks


def join_continuations(lines: list[str]) -> list[str]:
    return "\n".join(lines).replace("\\\n", " ").splitlines()


def shell_commands() -> list[str]:
    """The commands of the bash blocks (continuation lines joined, `&&` chains split) and the `$ ` lines of
    the output blocks."""
    commands = []
    for lang, lines in code_blocks():
        if lang == "bash":
            for line in join_continuations(lines):
                if line.strip() and not line.strip().startswith("#"):
                    commands += [part.strip() for part in line.split("&&")]
        elif lang == "":
            commands += [line[2:] for line in join_continuations(lines) if line.startswith("$ ")]
    return commands


def split_command(command: str) -> tuple[list[str], str, list[str]]:
    """(launcher tokens, script, script args) of `python X.py ...` or `torchrun [options] X.py ...`; a `...`
    token (the README's "and the rest as above") is dropped."""
    tokens = [t for t in shlex.split(command, comments=True) if t != "..."]
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
    assert script is not None and tokens[0] in ("python", "torchrun"), f"README command not understood: {command}"
    return tokens[:script], tokens[script], tokens[script + 1:]


def mask(line: str) -> str:
    """A line with every number replaced by '#' (signs included): what stays is its shape."""
    return re.sub(r"[+-]?\d+(\.\d+)?(e[+-]?\d+)?", "#", line.rstrip())


def assert_shows(expected: list[str], output: str, replace: dict[str, str] | None = None) -> None:
    """Every line the README shows has a line of the same shape in `output` (a `...` inside a line stands for
    any text; a line that is only `...` for lines left out). `replace` maps output text to what the README
    writes in its place (a temporary path to the README's)."""
    for old, new in (replace or {}).items():
        output = output.replace(old, new)
    actual = [mask(line) for line in output.splitlines()]
    for line in expected:
        if line.strip() in ("", "..."):
            continue
        pattern = ".*".join(re.escape(part) for part in mask(line).split("..."))
        assert any(re.fullmatch(pattern, a) for a in actual), f"README line not in the output:\n{line}\n\n{output}"


def output_block(command_start: str) -> tuple[str, list[str]]:
    """(command, output lines) of the README's `$ command` output block whose command starts so."""
    for lang, lines in code_blocks():
        lines = join_continuations(lines)
        if lang == "" and lines and lines[0].startswith(f"$ {command_start}"):
            return lines[0][2:], lines[1:]
    raise AssertionError(f"no README output block for `{command_start}`")


def test_every_readme_command_parses():
    """Each script accepts every flag the README passes it (a renamed or removed flag fails here)."""
    from torch.distributed.run import get_args_parser
    seen = set()
    for command in shell_commands():
        tokens = shlex.split(command, comments=True)
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
        launcher, script, args = split_command(command)
        try:
            if launcher[0] == "torchrun":
                get_args_parser().parse_args(launcher[1:] + [script])
            PARSERS[script]().parse_args(args)
        except (config.ConfigError, SystemExit) as e:
            raise AssertionError(f"README command does not parse ({e}): {command}") from None
        seen.add(script)
    assert seen == set(PARSERS), seen  # the README shows every command


@pytest.mark.timeout(300)
def test_readme_examples_reproduce_their_output(tmp_path, photos_dir):
    """Run from a fresh directory as a new user would, without cached weights and without a network (the
    README's outputs were made so): the demo (1 step instead of 300), then the evaluation example exactly as
    printed, then make-shards."""
    home = tmp_path / "home"
    env = cli_env(HOME=home, CUDA_VISIBLE_DEVICES="", HTTPS_PROXY="http://127.0.0.1:9",
                  https_proxy="http://127.0.0.1:9")
    for name in ("TORCH_HOME", "XDG_CACHE_HOME"):
        env.pop(name, None)
    work = tmp_path / "work"
    work.mkdir()

    def run(command: str, *extra: str):
        _, script, args = split_command(command)
        proc = run_cli(script, args + list(extra), env=env, cwd=str(work), timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    # the quick start: the demo, shortened; its lines have the README's shape
    command, shown = output_block("python vae_trainer.py --demo")
    proc = run(command, "--max_steps", "1", "--log_every_n_steps", "1", "--save_every_n_steps", "1",
               "--evaluate_every_n_steps", "1")
    assert_shows(shown, proc.stdout + proc.stderr, {str(home): "~"})
    sample_lines = [lines for lang, lines in code_blocks() if lang == "" and lines[0].startswith("step ")]
    assert len(sample_lines) == 1  # "Rank 0 prints a line every --log_every_n_steps"
    assert_shows(sample_lines[0], proc.stdout)

    # the evaluation example, as printed: the same keys, nulls where the README has nulls
    command, shown = output_block("python evaluate.py")
    proc = run(command)
    expected, actual = json.loads(shown[0]), json.loads(proc.stdout)
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert type(actual[key]) is type(value), (key, actual[key], value)
        if isinstance(value, str):
            assert mask(actual[key]) == mask(value), key
    assert (work / "eval" / "metrics.json").is_file() and (work / "eval" / "reconstructions.png").is_file()

    # make-shards with the output its comment lines show
    (_, lines), = [(lang, lines) for lang, lines in code_blocks() if lines[0].startswith("python data.py make-shards")]
    command = lines[0].replace("/data/my_photos", photos_dir).replace("/data/shards", str(tmp_path / "shards"))
    proc = run(command, "--shard_size", "3")  # 8 photos: 3 shards, as the README's brace range
    assert_shows([line[2:] for line in lines[1:] if line.startswith("# ")], proc.stdout,
                 {str(tmp_path / "shards"): "/data/shards"})


def test_the_layout_keeps_its_promises():
    """The README's Layout: no module imports another in a circle (loading a trained VAE lives in checkpoint.py,
    below evaluate.py and export.py), vae_trainer.py stays under 700 lines and no class over 300."""
    import ast
    modules = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    trees = {m: ast.parse(open(os.path.join(ROOT, m + ".py")).read()) for m in modules}
    imports = {}
    for name, tree in trees.items():
        found = set()
        for node in ast.walk(tree):  # imports inside functions count too
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
        imports[name] = found & modules - {name}

    def reaches(start, target, seen=()):
        return any(m == target or (m not in seen and reaches(m, target, seen + (m,))) for m in imports[start])
    assert [m for m in sorted(modules) if reaches(m, m)] == []
    assert len(open(os.path.join(ROOT, "vae_trainer.py")).read().splitlines()) < 700
    long_classes = [(m, node.name, node.end_lineno - node.lineno + 1) for m, tree in trees.items()
                    for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                    and node.end_lineno - node.lineno + 1 > 300]
    assert long_classes == []
