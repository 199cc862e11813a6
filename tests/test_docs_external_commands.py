"""The commands of other tools the README and the docs tell users to type: every `vllm serve …`
line parses with the serve parser of the vLLM the project installs and its `--speculative-config`
names only fields vLLM's SpeculativeConfig has; every `prefect …` command names a sub-command and
flags the installed Prefect has. A renamed flag or key in an upgrade fails here, not in a user's
terminal."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs_commands import PAGES, commands

pytestmark = pytest.mark.slow  # imports vLLM's argument parsers (~7 s), runs Prefect's CLI per command

VLLM_SERVE = re.compile(r"^(?:\$\s+)?vllm\s+serve\s")
SUBSTITUTION = re.compile(r"\$\([^)]*\)")
# Runs in the vLLM venv: parse each argv with `vllm serve`'s own parser, check the spec-config keys.
CHECK = """
import dataclasses, json, sys
from vllm.config import SpeculativeConfig
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
problems = []
for i, argv in enumerate(json.load(sys.stdin)):
    top = FlexibleArgumentParser(prog="vllm", exit_on_error=False)
    ServeSubcommand().subparser_init(top.add_subparsers(dest="subparser"))
    try:
        args, unknown = top.parse_known_args(argv)
    except (SystemExit, Exception) as error:
        problems.append([i, f"does not parse: {error}"])
        continue
    if unknown:
        problems.append([i, f"unknown arguments {unknown}"])
    extra = sorted(set(args.speculative_config or {}) - fields)
    if extra:
        problems.append([i, f"--speculative-config keys vLLM does not have: {extra}"])
print(json.dumps(problems))
"""


def serve_lines() -> list[tuple[str, int, str]]:
    return [(page.name, n, line) for page in PAGES for n, line in commands(page, VLLM_SERVE)]


def argv_of(line: str) -> list[str]:
    # a shell substitution stands for the folder it prints
    words = shlex.split(SUBSTITUTION.sub("./FOLDER", line), comments=True)
    return words[words.index("vllm") + 1 :]


WRONG = [
    ["serve", "./m", "--speculative-confg", "{}"],
    ["serve", "./m", "--speculative-config", '{"model": "./d", "num_speculative_token": 1}'],
]


@pytest.fixture(scope="module")
def checked(vllm_python) -> tuple[list, dict[int, str]]:
    """The documented lines and what vLLM's parser said of them and of WRONG (one vLLM import)."""
    lines = serve_lines()
    argvs = [argv_of(line) for _, _, line in lines] + WRONG
    done = subprocess.run(
        [vllm_python, "-c", CHECK], input=json.dumps(argvs), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return lines, dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_every_documented_vllm_serve_line_parses_with_vllms_own_parser(checked):
    lines, problems = checked
    assert len(lines) >= 4 and any("--speculative-config" in line for _, _, line in lines)
    assert [f"{page}:{n}: {problems[i]}" for i, (page, n, _) in enumerate(lines) if i in problems] == []


def test_the_check_catches_a_misspelt_flag_and_an_unknown_config_key(checked):
    lines, problems = checked
    assert [problems.get(len(lines) + k, "").split(":")[0] for k in range(len(WRONG))] == [
        "unknown arguments ['--speculative-confg', '{}']",
        "--speculative-config keys vLLM does not have",
    ]


PREFECT_LINE = re.compile(r"^(?:\$\s+)?(?:[A-Z_]+=\S+\s+)*prefect\s")
PREFECT_INLINE = re.compile(r"`((?:[A-Z_]+=\S+\s+)*prefect [a-z][^`]*)`")


def prefect_commands() -> list[tuple[str, int, str]]:
    """`prefect …` in shell blocks and in inline code of the README and the docs."""
    found = [(page.name, n, line) for page in PAGES for n, line in commands(page, PREFECT_LINE)]
    for page in PAGES:
        for n, text in enumerate(page.read_text().splitlines(), 1):
            found += [(page.name, n, m) for m in PREFECT_INLINE.findall(text)]
    return found


def prefect_argv(line: str) -> list[str]:
    words = [w for w in shlex.split(line, comments=True) if not re.match(r"^[A-Z_]+=", w)]
    return words[words.index("prefect") + 1 :]


def test_every_documented_prefect_command_exists_with_its_flags():
    """`prefect SUB … --help` exits 0 only for a sub-command that exists (its arguments are not
    checked then), so each `--flag` of the line must also appear in that help."""
    found = prefect_commands()
    assert {"server", "worker", "concurrency-limit", "deploy"} <= {prefect_argv(c)[0] for _, _, c in found}
    prefect = str(Path(sys.executable).parent / "prefect")
    problems, seen = [], {}
    for page, n, line in found:
        argv = prefect_argv(line)
        words = [w for w in argv if not w.startswith("-")]
        key = tuple(words[:2])
        if key not in seen:
            wide = {**os.environ, "COLUMNS": "300", "NO_COLOR": "1"}  # no option name folded
            done = subprocess.run(
                [prefect, *key, "--help"], capture_output=True, text=True, timeout=60, env=wide
            )
            seen[key] = done.returncode, done.stdout
        code, help_text = seen[key]
        if code != 0:
            problems.append(f"{page}:{n}: `prefect {' '.join(key)}` is not a Prefect command")
            continue
        flags = [w.split("=")[0] for w in argv if w.startswith("--")]
        problems += [f"{page}:{n}: `prefect {' '.join(key)}` has no {f}" for f in flags if f not in help_text]
    assert problems == []
