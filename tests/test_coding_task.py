"""The shipped coding task: its problems, each reward level, markdown handling, and the sandbox that runs the code."""

import os
import shutil
import socket
import time
import uuid

import pytest

from comlrl_core.environments import sandbox
from comlrl_core.environments.coding import (CODING_PROMPTS, DEFINED, NO_CODE, PASSED, USES_HELPER, coding_dataset,
                                             coding_reward, extract_code)
from comlrl_core.environments.sandbox import run_python
from comlrl_core.prompts import PromptTemplate

ALL = coding_dataset("train") + coding_dataset("eval")
ITEM = next(item for item in ALL if item["id"] == "title_case")
HELPER, MAIN = ITEM["helper_solution"], ITEM["main_solution"]
FIELDS = ("id", "problem", "helper_name", "helper_signature", "helper_description", "main_name", "main_signature",
          "main_description", "tests", "helper_solution", "main_solution")


def reward(helper: str, main: str, **kwargs) -> float:
    return coding_reward([helper], [main], batch_items=[ITEM], **kwargs)[0]


def main_doing(statement: str) -> str:
    """The reference main function, running ``statement`` first: it passes exactly when the statement may run."""
    return MAIN.replace("    return ", f"    {statement}\n    return ", 1)


# The dataset.

def test_splits_are_sized_disjoint_and_deterministic():
    train, held_out = coding_dataset("train"), coding_dataset("eval")
    assert len(train) + len(held_out) >= 40 and len(ALL) == len({item["id"] for item in ALL})
    assert 0.15 <= len(held_out) / len(ALL) <= 0.25
    assert not {item["id"] for item in train} & {item["id"] for item in held_out}
    assert coding_dataset() == train == coding_dataset("train") and coding_dataset("eval") == held_out
    train[0]["problem"] = "changed"  # items are copies
    assert coding_dataset("train")[0]["problem"] != "changed"


def test_an_unknown_split_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"split='test'.*'train' and 'eval'"):
        coding_dataset("test")


@pytest.mark.parametrize("item", ALL, ids=lambda item: item["id"])
def test_each_problem_is_well_formed_and_its_reference_solution_passes(item):
    assert set(item) == set(FIELDS) and all(isinstance(item[key], str) and item[key] for key in FIELDS)
    for role in ("helper", "main"):
        assert item[f"{role}_signature"].startswith(f"def {item[f'{role}_name']}(")
        assert item[f"{role}_solution"].startswith(item[f"{role}_signature"] + ":")
    assert item["helper_name"] != item["main_name"]
    assert all(line.startswith("assert ") and f"{item['main_name']}(" in line for line in item["tests"].splitlines())
    assert coding_reward([item["helper_solution"]], [item["main_solution"]], batch_items=[item]) == [PASSED]


def test_prompts_ask_each_agent_for_its_function_without_showing_solutions():
    class Tokenizer:
        chat_template = "stub"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "\n".join(f"<{m['role']}>{m['content']}" for m in messages) + "\n<assistant>"

    assert len(CODING_PROMPTS) == 2 and all(isinstance(p, PromptTemplate) for p in CODING_PROMPTS)
    for item in ALL:
        helper_prompt, main_prompt = (p.check(item, Tokenizer(), "coding") or p.render(item, Tokenizer())
                                      for p in CODING_PROMPTS)
        assert item["problem"] in helper_prompt and item["helper_signature"] in helper_prompt
        assert item["main_signature"] not in helper_prompt
        assert all(item[key] in main_prompt for key in ("problem", "helper_signature", "main_signature"))
        for prompt in (helper_prompt, main_prompt):
            for solution in (item["helper_solution"], item["main_solution"]):
                assert solution.splitlines()[1].strip() not in prompt


# The reward levels.

def test_every_reward_level_is_reached():
    solo_main = ('def title_case(sentence: str) -> str:\n'
                 '    return " ".join(w[:1].upper() + w[1:].lower() for w in sentence.split())\n')
    assert reward("def title_case(:", MAIN) == reward(HELPER, "not code at all") == NO_CODE
    assert reward("", "") == reward(HELPER.replace("capitalize_word", "capital"), MAIN) == NO_CODE
    assert reward(HELPER, MAIN.replace("def title_case", "def titles")) == NO_CODE
    assert reward(HELPER, solo_main) == DEFINED  # correct, but agent 0's helper is unused
    assert reward(HELPER, MAIN + "\n\ndef capitalize_word(word):\n    return word.title()\n") == DEFINED  # shadowed
    wrong_main = "def title_case(sentence: str) -> str:\n    return capitalize_word(sentence)\n"
    assert reward(HELPER, wrong_main) == USES_HELPER
    assert reward("def capitalize_word(word: str) -> str:\n    return word\n", MAIN) == USES_HELPER
    assert reward(HELPER, MAIN) == PASSED
    assert NO_CODE == 0.0 < DEFINED < USES_HELPER < PASSED == 1.0
    assert coding_reward(["nope", HELPER, HELPER, HELPER], [MAIN, solo_main, main_doing("assert False"), MAIN],
                         batch_items=[ITEM]) == [NO_CODE, DEFINED, USES_HELPER, PASSED]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="2 helper completions but 1 main"):
        coding_reward([HELPER, HELPER], [MAIN], batch_items=[ITEM])
    with pytest.raises(ValueError, match="batch_items"):
        coding_reward([HELPER], [MAIN], batch_items=[])
    with pytest.raises(ValueError, match="lacks"):
        coding_reward([HELPER], [MAIN], batch_items=[{"prompt": "x"}])


@pytest.mark.parametrize("wrap", [
    lambda code: f"Here is the function:\n```python\n{code}```\nIt capitalizes each word.",
    lambda code: f"```\n{code}\n```",
    lambda code: f"```py\n{code}",  # cut off before the closing fence
    lambda code: f"Usage:\n```python\nprint('example')\n```\nCode:\n```python\n{code}```\n```text\nout\n```",
], ids=["prose", "bare-fence", "unclosed", "several-blocks"])
def test_markdown_fences_are_stripped(wrap):
    assert reward(wrap(HELPER), wrap(MAIN)) == PASSED


def test_extract_code():
    assert extract_code("  x = 1\n") == "x = 1"
    assert extract_code("```python\na = 1\n```\n```python\ndef f():\n    pass\n```", "f") == "def f():\n    pass"
    assert extract_code("```python\na = 1\n```\n```python\nb = 2\n```", "f") == "a = 1"


# The sandbox, through the reward: each bad action would pass if it were allowed.

def test_writing_inside_its_directory_is_allowed():
    assert reward(HELPER, main_doing("open('scratch.txt', 'w').write('x')")) == PASSED


def test_an_endless_loop_fails_within_the_timeout():
    start = time.monotonic()
    assert reward(HELPER, main_doing("while True: pass"), timeout=1.0) == NO_CODE
    assert time.monotonic() - start < 1.0 + 3.0


def test_writes_outside_its_directory_fail_and_change_nothing(tmp_path):
    created = f"/tmp/comlrl-sandbox-escape-{uuid.uuid4().hex}"
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "inner.txt").write_text("keep me too")
    try:
        assert reward(HELPER, main_doing(f"open({created!r}, 'w').write('x')")) == NO_CODE
        assert reward(HELPER, main_doing(f"import os; os.remove({str(precious)!r}) "
                                         f"if os.path.exists({str(precious)!r}) else None")) == NO_CODE
        assert reward(HELPER, main_doing(f"import pathlib; pathlib.Path({created!r}).touch()")) == NO_CODE
        for code in (f"import shutil; shutil.rmtree({str(folder)!r})",
                     f"import os; os.rename({str(precious)!r}, 'stolen.txt')",
                     f"import os; os.symlink({str(precious)!r}, 'link'); open('link', 'w').write('x')",
                     f"import os; os.open({created!r}, os.O_CREAT | os.O_WRONLY)",
                     f"import io; io.FileIO({str(precious)!r}, 'w')"):
            result = run_python(code)
            assert not result.passed and "PermissionError" in result.output, code
        assert not os.path.exists(created)
        assert precious.read_text() == "keep me" and (folder / "inner.txt").read_text() == "keep me too"
    finally:
        if os.path.exists(created):
            os.remove(created)


def test_sockets_fail_and_connect_to_nothing():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1).close()"
        assert reward(HELPER, main_doing(connect)) == NO_CODE
        for code in (f"import socket; s = socket.socket(); s.connect(('127.0.0.1', {port}))",
                     f"import _socket; s = _socket.socket(); s.connect(('127.0.0.1', {port}))",
                     "import socket; socket.getaddrinfo('localhost', 80)",
                     f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)"):
            assert not run_python(code).passed, code
        listener.settimeout(0.3)
        with pytest.raises(TimeoutError):
            listener.accept()


def test_a_memory_bomb_fails_without_harming_us():
    assert reward(HELPER, main_doing("bytearray(16 << 30)")) == USES_HELPER
    result = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))", memory_mb=256, timeout=10)
    assert not result.passed and not result.timed_out and "MemoryError" in result.output


@pytest.mark.parametrize("statement", ["import sys; sys.exit(0)", "raise SystemExit(0)", "import os; os._exit(0)"])
def test_exiting_before_the_tests_is_no_pass(statement):
    assert reward(HELPER, MAIN + statement + "\n") in (NO_CODE, USES_HELPER)


@pytest.mark.parametrize("code", ["import os\nos.fork()", "import subprocess", "import os\nos.system('true')",
                                  "import os\nos.kill(os.getppid(), 0)", "import os\nos.setsid()",
                                  "import ctypes", "import multiprocessing\nmultiprocessing.Process().start()"])
def test_processes_and_signals_are_blocked(code):
    result = run_python(code)
    assert not result.passed and ("blocked" in result.output or "ImportError" in result.output), result.output


# The sandbox itself.

def test_run_python_reports_what_happened(monkeypatch):
    monkeypatch.setenv("COMLRL_TEST_SECRET", "hunter2")
    ok = run_python("import os\nprint('hello', os.getcwd())\nassert 'COMLRL_TEST_SECRET' not in os.environ")
    assert ok.passed and not ok.timed_out and ok.returncode == 0 and ok.output.startswith("hello ")
    workdir = ok.output.split()[1]
    assert os.path.basename(workdir).startswith("comlrl-sandbox-") and not os.path.exists(workdir)
    failed = run_python("assert 1 == 2")
    assert not failed.passed and failed.returncode == 1 and "AssertionError" in failed.output
    assert not run_python("def f(:").passed
    broken = run_python("x = '\udc80'")  # not encodable: the code cannot even be written out
    assert not broken.passed and broken.returncode is None
    slow = run_python("import time\ntime.sleep(60)", timeout=0.5)
    assert slow.timed_out and not slow.passed and "timed out" in slow.output
    assert len(run_python("print('x' * 100_000)").output) <= sandbox.OUTPUT_CHARS
    with pytest.raises(ValueError, match="timeout"):
        run_python("pass", timeout=0)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root switches to the unprivileged user")
def test_as_root_the_code_runs_as_nobody_when_the_interpreter_allows(monkeypatch):
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if python is None or not sandbox._unprivileged(python):
        pytest.skip("no system Python that the unprivileged user can run")
    monkeypatch.setattr(sandbox, "PYTHON", python)
    result = run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())\nopen('here.txt', 'w').write('x')")
    assert result.passed and result.output.split() == [str(sandbox.NOBODY), str(sandbox.NOBODY), "[]"]
