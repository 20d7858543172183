"""What the diffs between neighbouring scripts hold: each script's own lessons, tagged where they happen; an earlier tag
kept; a piece the copy table names carried unchanged but for the later script's tagged lessons; imports a learner can
follow (the standard library, torch, torchvision, common.py; never the lab)."""
import ast
import collections
import difflib
import inspect
import os
import re
import sys
from pathlib import Path

import pytest

import common
import machine
from conftest import ALL_SCRIPTS, ROOT, SMALL, run_python


@pytest.mark.parametrize("module", [*ALL_SCRIPTS.values(), common, machine],
                         ids=[*ALL_SCRIPTS, "common.py", "machine.py"])
def test_no_function_takes_more_than_six_parameters(module):
    # Settings reach train_one_epoch and evaluate as one object, `run`: a signature names what the function works on.
    functions = [value for value in vars(module).values()
                 if inspect.isfunction(value) and value.__module__ == module.__name__]
    parameters = {function.__name__: len(inspect.signature(function).parameters) for function in functions}
    assert "train_one_epoch" in parameters or module in (common, machine)
    assert {name: count for name, count in parameters.items() if count > 6} == {}


def project_imports(path):
    """The top-level modules `path` imports, by the first part of each name."""
    tree = ast.parse(path.read_text())
    return {(node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
            for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names}


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_a_chain_script_imports_the_standard_library_torch_torchvision_and_common_alone(script):
    # A learner opens the script and common.py, nothing else: what the script teaches is in it
    imported = project_imports(ROOT / script) - set(sys.stdlib_module_names)
    assert imported <= {"torch", "torchvision", "common"}, imported
    assert "common" in imported


def test_common_calls_machine_which_imports_nothing_of_the_project_and_the_chain_imports_nothing_of_the_lab():
    chain, lab = {path.stem for path in ROOT.glob("*.py")}, {path.stem for path in (ROOT / "lab").glob("*.py")}
    assert project_imports(ROOT / "machine.py") & (chain | lab) == set(), "machine.py: verdicts only, no cycle"
    assert project_imports(ROOT / "common.py") & (chain | lab) == {"machine"}
    # the lab imports the scripts, never the reverse: no file at the root, tests included, imports a module of lab/
    assert {path.name: project_imports(path) & lab for path in ROOT.glob("*.py") if project_imports(path) & lab} == {}
    # and the lab finds the chain in one place: lab/root.py, which its tools and tests import before the chain's
    for path in (ROOT / "lab").glob("*.py"):
        uses = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
                and node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys"]
        assert not uses or path.name == "root.py", f"lab/{path.name} touches sys.path itself"


def test_opt6_holds_torchruns_start_the_download_turns_ddps_keyword_and_the_exit_each_tagged_where_it_happens():
    tagged = [code for tag, code in tagged_lines("opt6.py") if tag.startswith("# opt6:")]
    for name in ("started_by_torchrun()", "point_to_torchrun(", "rank_zero_first(", "broadcast_buffers_keyword()",
                 "leave_process_group()"):
        assert any(name in code for code in tagged), f"{name} is not called on a line tagged # opt6:"
        assert f"def {name.split('(')[0]}(" in (ROOT / "opt6.py").read_text()


TAG = re.compile(r"# (opt\d): (.+)$")


def tagged_lines(script):
    """[(tag, the code line it marks)] of `script`: an inline `# optN:` tag marks its own line, one on a line of its own
    the next line of code (several above one line all mark it)."""
    pairs, waiting = [], []
    for line in (ROOT / script).read_text().splitlines():
        code, _, comment = line.partition("# ") if line.strip().startswith("#") else line.partition("  # ")
        if match := TAG.match("# " + comment):
            waiting.append(match[0])
        if code.strip():
            pairs += [(tag, code.strip()) for tag in waiting]
            waiting = []
    return pairs


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_a_script_tags_only_its_own_and_earlier_lessons(script):
    number = list(ALL_SCRIPTS).index(script)  # baseline 0, opt1 1, ...
    assert tagged_lines(script) or script == "baseline.py"
    assert [tag for tag, _ in tagged_lines(script) if int(tag[5]) > number] == []


@pytest.mark.parametrize("earlier, later", list(zip(list(ALL_SCRIPTS)[1:], list(ALL_SCRIPTS)[2:])))
def test_a_later_script_keeps_an_earlier_tag_word_for_word_on_a_line_it_keeps(earlier, later):
    # A line kept (as often: a line that appears once in each) keeps its tags, or carries the later script's own
    # tag instead, where its reason changed there (opt5's padded evaluation batch)
    later_pairs = tagged_lines(later)
    later_lines, earlier_lines = (collections.Counter(line.partition("  # ")[0].strip() for line in
                                                      (ROOT / script).read_text().splitlines())
                                  for script in (later, earlier))
    dropped = []
    for tag, code in tagged_lines(earlier):
        tags_there = {later_tag for later_tag, later_code in later_pairs if later_code == code}
        own = {later_tag for later_tag in tags_there if later_tag[:6] == f"# {Path(later).stem}"}
        if later_lines[code] >= earlier_lines[code] > 0 and tag not in tags_there and not own:
            dropped.append((tag, code))
    assert dropped == []


def test_a_chain_script_asks_git_nothing_and_imports_no_tool(tmp_path):
    # The run is the lesson: where its code came from is the lab's business (lab/accounting.py), read once as its tools
    # start. A git that leaves a mark on every call shows whether --help or a run asked it anything.
    (tmp_path / "bin").mkdir()
    fake_git = tmp_path / "bin" / "git"
    fake_git.write_text(f"#!/bin/sh\ntouch {tmp_path / 'asked'}\nexit 1\n")
    fake_git.chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    assert run_python("opt5.py", "--help", env=env).returncode == 0
    result = run_python("-X", "importtime", "baseline.py", *SMALL, "--epochs", 1, "--train-size", 64, "--json",
                        tmp_path / "row.json", env=env)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "asked").exists(), "a chain script ran git"
    imported = set(re.findall(r"\|\s+(\w+)$", result.stderr, flags=re.MULTILINE))
    assert {"common", "machine"} <= imported and not imported & {"accounting", "benchmark", "plot"}


# ------------------------------------------------------------------ a carried piece stays the same piece

# Untagged differences of a carried piece that are no lesson of the later script, each with its reason
NOT_A_LESSON = {
    ("opt5.py", "micro_batch_loss", "docstring"): "it says what the tagged downscale line in the body adds",
}


def copied_pieces():
    """{name: the script the README's copy table names it from}, for its functions, classes and RECIPE (a name in a
    later row too, as opt5's micro_batch_loss, keeps the first)."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## What to copy first"):].split("\n\n")[1].splitlines()[2:]
    pieces = {}
    for segment in (segment for row in table for segment in row.split("|")[2].split("; ")):
        if script := re.search(r"\b(opt\d)\b", segment.partition("settings")[0]):
            pieces.update({name: f"{script[1]}.py" for name in re.findall(r"`(\w+)`", segment) if name not in pieces})
    return pieces


def top_level_sources(text):
    """{name: (its lines, the indices of its docstring's lines)} of the top-level functions, classes and assignments
    (RECIPE) in `text`."""
    lines, found = text.splitlines(), {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign):
            found.update({target.id: (lines[node.lineno - 1:node.end_lineno], range(0)) for target in node.targets
                          if isinstance(target, ast.Name)})
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
            docstring = node.body[0] if ast.get_docstring(node) is not None else None
            span = range(docstring.lineno - first, docstring.end_lineno - first + 1) if docstring else range(0)
            found[node.name] = lines[first - 1:node.end_lineno], span
    return found


def untagged_hunks(name, earlier, later, later_text=None):
    """The hunks where script `later`'s copy of `name` (in `later_text`, if given) differs from script `earlier`'s,
    none of their lines tagged `# optN:` by `later` itself (a deletion is judged by the lines around it) and no reason
    in NOT_A_LESSON."""
    before, _ = top_level_sources((ROOT / earlier).read_text())[name]
    after, docstring = top_level_sources(later_text or (ROOT / later).read_text())[name]
    tag, found = f"# {Path(later).stem}:", []
    for kind, i1, i2, j1, j2 in difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes():
        changed = range(j1, j2) if j2 > j1 else range(max(j1 - 1, 0), min(j1 + 1, len(after)))
        part = "docstring" if all(index in docstring for index in changed) else "code"
        tagged = any(tag in after[index] for index in changed)
        if kind != "equal" and not tagged and (later, name, part) not in NOT_A_LESSON:
            found.append((before[i1:i2], after[j1:j2]))
    return found


@pytest.mark.parametrize("name, script", copied_pieces().items())
def test_a_copied_piece_a_later_script_carries_differs_only_where_that_script_tags_a_lesson(name, script):
    # What the copy table names is what a reader copies; a later script's copy, read in its diff, is the same piece
    # plus that script's own lessons, each tagged: so a fix made to one copy and missed in another fails here
    carriers = [later for later in list(ALL_SCRIPTS)[list(ALL_SCRIPTS).index(script):]
                if name in top_level_sources((ROOT / later).read_text())]
    assert carriers[:1] == [script], f"{script} defines no {name}"
    for earlier, later in zip(carriers, carriers[1:]):
        assert untagged_hunks(name, earlier, later) == [], f"{later}'s {name} differs from {earlier}'s untagged"


# The changes a missed fix leaves: opt5's cuda_graph keeping a failed capture's graph, its optimizer_step ignoring a
# group's lr_scale, its make_train_step without the float-rate check; a comment reworded; opt6's docstring reworded
@pytest.mark.parametrize("earlier, later, name, old, new", [
    ("opt4.py", "opt5.py", "cuda_graph", "graph, cause = None, error", "cause = error"),
    ("opt4.py", "opt5.py", "optimizer_step", 'rate * group["lr_scale"] if "lr_scale" in group else rate', "rate"),
    ("opt4.py", "opt5.py", "make_train_step", "raise TypeError(", "print("),
    ("opt4.py", "opt5.py", "augment", "# a flip reads the crop's columns backwards", "# a flip reads them backwards"),
    ("opt5.py", "opt6.py", "micro_batch_loss", "correct count", "correct tally"),  # only opt5's docstring exempt
])
def test_the_carried_piece_check_fails_on_a_changed_line_its_script_does_not_tag(earlier, later, name, old, new):
    text = (ROOT / later).read_text()
    piece = "\n".join(top_level_sources(text)[name][0])
    assert old in piece
    assert untagged_hunks(name, earlier, later, text.replace(piece, piece.replace(old, new, 1))) != []


def test_opt6_stays_one_lesson_on_top_of_opt5_at_most_230_changed_lines():
    # `diff -u opt5.py opt6.py | grep -c '^[+-]'`: data parallelism under any launcher, not a second rewrite
    before, after = ((ROOT / name).read_text().splitlines() for name in ("opt5.py", "opt6.py"))
    changed = [line for line in difflib.unified_diff(before, after, lineterm="", n=3) if line[:1] in "+-"]
    assert len(changed) <= 230, len(changed)  # the headers (--- and +++) count, as grep counts them
