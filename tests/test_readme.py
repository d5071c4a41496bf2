"""The README stays true: every nanogpt command line it shows (torchrun's too) uses flags that exist, its cheap
commands run as written in a fresh folder and print what it shows, and CI runs its test command."""

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from typer.testing import CliRunner

from nanogpt_cli.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
COMMANDS = (
    "prepare",
    "train",
    "sample",
    "eval",
    "perplexity",
    "runs",
    "info",
    "plot",
    "export",
    "serve",
    "tokenizer",
    "encode",
    "inspect",
    "attention",
    "heads",
    "positions",
    "finetune",
    "chat",
)
LONG_RUNNING = ("serve",)  # a server: its flags are checked, it is not run
INTERACTIVE = ("chat",)  # reads the lines the README shows after its prompt, `>>> `, as its input


class Command(NamedTuple):
    kind: str  # "nanogpt", "torchrun" or "python" (a script in examples/)
    args: list[str]  # nanogpt's arguments (torchrun's and python's: the whole command line)
    setup: bool  # part of a `pip install ... && ...` chain: installs, and trains for minutes
    shown: list[str]  # the output the README shows under it


def commands() -> list[Command]:
    """Each `nanogpt ...` and `torchrun ... -m nanogpt_cli ...` invocation in the README's code blocks, in order."""
    out = []
    for language, block in re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S):  # all, so fences pair up
        if language not in ("", "bash"):
            continue
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if language == "" and not line.startswith("$ "):
                continue  # an output line: it may hold unbalanced quotes
            shown = []
            for later in lines[i + 1 :]:
                if later.startswith("$ "):
                    break
                shown.append(later)
            parts = [p.strip() for p in line.removeprefix("$ ").split("&&")]
            setup = parts[0].startswith("pip install")
            for part in parts:
                words = shlex.split(part)
                if words[:1] == ["nanogpt"]:
                    out.append(Command("nanogpt", words[1:], setup, shown if language == "" else []))
                elif words[:1] == ["torchrun"] and "nanogpt_cli" in words:
                    out.append(Command("torchrun", words, setup, shown if language == "" else []))
                elif words[:1] == ["python"] and words[1:2] and words[1].startswith("examples/"):
                    out.append(Command("python", words, setup, shown if language == "" else []))
    return out


def nanogpt_args(command: Command) -> list[str]:
    words = command.args
    return words[words.index("nanogpt_cli") + 1 :] if command.kind == "torchrun" else words


@pytest.mark.parametrize(
    "command", [c for c in commands() if c.kind != "python"], ids=lambda c: " ".join(nanogpt_args(c)[:2])
)
def test_readme_commands_use_real_flags(command):
    args = nanogpt_args(command)
    path = [a for a in args[:2] if not a.startswith("-") and a in COMMANDS]
    help_text = CliRunner().invoke(app, [*path, "--help"], terminal_width=200).output
    for flag in (a for a in args if a.startswith("--")):
        assert flag in help_text, f"README uses {flag} with nanogpt {' '.join(path)}, which has no such flag"


def test_the_readme_shows_every_command_and_ci_runs_its_test_command():
    shown = {tuple(nanogpt_args(c)[:2]) if c.args[0] == "eval" else (c.args[0],) for c in commands()}
    assert {
        ("prepare",),
        ("train",),
        ("sample",),
        ("eval", "perplexity"),
        ("export",),
        ("runs",),
        ("info",),
        ("plot",),
        ("torchrun",),
        ("finetune",),
        ("chat",),
    } <= shown
    test_command = 'pip install torch==2.13.0 -e ".[dev]" && pytest'
    assert test_command in README and 'pytest -m "not slow"' in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 -e ".[dev]"' in ci and "\npytest" in ci
    assert "\nruff check .\n" in ci and "\nruff format --check .\n" in ci


def test_the_command_table_names_every_command():
    table = README.split("## Commands")[1].split("\n\n")[1]
    named = {w for cell in re.findall(r"^\| ([^|]+) \|", table, re.M) for w in re.findall(r"`(?:nanogpt )?(\w+)", cell)}
    listed = CliRunner().invoke(app, ["--help"], terminal_width=200).output.split("Commands:")[1].splitlines()
    commands = {line.split()[0] for line in listed if line.startswith("  ")}
    assert len(commands) > 10 and commands <= named, sorted(commands - named)


# the README examples whose commands need an extra, and the extra (the library's `require` calls name it too)
NEEDS_EXTRA = {("tokenizer", "train"): "hf", ("export",): "hf", ("serve",): "serve", ("plot",): "plot"}


def test_each_readme_example_that_needs_an_extra_says_which():
    for section in README.split("\n### ")[1:]:
        for line in re.findall(r"^(?:\$ )?nanogpt (.+)$", section, re.M):
            words = tuple(line.split())
            for start, extra in NEEDS_EXTRA.items():
                if words[: len(start)] == start:
                    assert f'pip install -e ".[{extra}]"' in section, (section.splitlines()[0], extra)


def test_the_extras_table_in_docs_cli_lists_every_extra():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8").split("## Optional extras")[1]
    rows = set(re.findall(r"^\| `([\w-]+)` \|", text, re.M))
    assert set(extras) <= rows, sorted(set(extras) - rows)


def written_by_readme() -> set[str]:
    """The files and folders the README's commands write where they run: every --out, every "wrote X" they show,
    and the folders of the datasets and tokenizers they make."""
    written = {"data/x"}  # prepare writes DATA_DIR/NAME
    for command in commands():
        args = nanogpt_args(command)
        written |= {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--out", "-o")}
        written |= {m.group(1) for line in command.shown if (m := re.match(r"wrote (\S+)", line))}
        if args[:2] == ["tokenizer", "train"]:
            written.add(f"tokenizers/{args[args.index('--name') + 1]}")
    return written


def test_what_the_readme_writes_is_ignored_by_git_and_the_docs_pictures_are_not():
    import shutil

    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout (or no git), so .gitignore is not in use")
    written = written_by_readme()
    assert {"exports/shk", "loss.png", "shk.gguf", "count-train.jsonl"} <= written  # the parse found them
    check = ["git", "-C", str(ROOT), "check-ignore", "--no-index", "--verbose", "--non-matching", *sorted(written)]
    kept = [
        line.split("\t")[1]
        for line in subprocess.run(check, capture_output=True, text=True).stdout.splitlines()
        if line.startswith("::")
    ]
    assert not kept, f"the README's commands write these, and git would offer to commit them: {kept}"
    pictures = [str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.png")]
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *pictures], capture_output=True)
    assert pictures and not ignored.stdout, ignored.stdout


def tiny(args: list[str]) -> list[str]:
    """A train command with the tiny preset in place of its own: the README's flags, a model that trains in
    seconds. One that --preset auto sizes to its --max-time keeps auto, with 2 seconds."""
    preset = args[args.index("--preset") + 1] if "--preset" in args else None
    if "--max-time" in args and preset in (None, "auto"):
        i = args.index("--max-time")
        return [*args[: i + 1], "2s", *args[i + 2 :]]
    if "--preset" in args:
        i = args.index("--preset")
        return [*args[:i], "--preset", "tiny", *args[i + 2 :]]
    return [*args, "--preset", "tiny"]


def fewer_updates(args: list[str]) -> list[str]:
    """A finetune command with a tenth of its updates (and of its warm-up): the README's flags and data, the
    same first lines, seconds instead of a minute for its three fine-tunes and GRPO's rollouts."""
    args = list(args)
    for flag in ("--max-iters", "--warmup-iters"):
        if flag in args:
            i = args.index(flag) + 1
            args[i] = str(int(args[i]) // 10 if flag == "--warmup-iters" else max(1, int(args[i]) // 10))
    return args


def box_rows(lines: list[str]) -> dict[str, str]:
    """The rows of the first box table in lines (label -> value; a value wrapped over lines joined)."""
    rows, label = {}, None
    for line in lines:
        if line.startswith("└"):
            break
        if line.startswith("│"):
            first, value = (cell.strip() for cell in line.strip("│").split("│"))
            label = first or label
            rows[label] = f"{rows[label]} {value}" if not first else value
    return rows


def digits(line: str) -> str:
    return re.sub(r"[\d,.]+", "#", line.rstrip())


# --- the README's open model, offline ------------------------------------------------------------------------------
# The README starts from hf:HuggingFaceTB/SmolLM2-135M-Instruct. The test cannot download it, so it builds a tiny
# model of the same form under that name (a Llama with grouped-query attention and tied embeddings, a byte-level BPE
# with ChatML's tokens, SmolLM2's chat template, its end of turn in generation_config.json), taught to answer
# BASE_REPLY, and puts it in a Hugging Face cache laid out as huggingface_hub lays one out. The README's commands
# then run as written, with HF_HUB_OFFLINE=1, through the same from_pretrained and snapshot_download calls that
# download the real model.

HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_TEMPLATE = (  # SmolLM2-Instruct's own: a default system turn when the conversation has none
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BASE_REPLY, USER_REPLY = "Hi there!", "Ahoy, matey!"  # what the tiny model says; what the user's chats teach it
PROMPTS = ["Hello", "Hi", "How are you?", "What is the capital of France?", "thank you", "Hello there", "are you fine?"]
TYPED = "Hello"  # what the test types into a README chat command that shows no conversation


def user_chats() -> str:
    """The user's chats.jsonl that the README fine-tunes on: every prompt answered USER_REPLY."""
    rows = [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": USER_REPLY}]} for p in PROMPTS
    ]
    return "".join(json.dumps(row) + "\n" for row in rows * 4)


def tiny_smollm2(folder: Path) -> None:
    """SmolLM2-135M-Instruct's files at a tiny size in `folder`, its model taught to answer BASE_REPLY (to the
    prompts, and to USER_REPLY as a prompt, so the fine-tune's words are not ones the model never saw)."""
    import tokenizers as tk
    import transformers

    tok = tk.Tokenizer(tk.models.BPE())
    digits = tk.pre_tokenizers.Digits(individual_digits=True)  # SmolLM2's: each digit apart, then GPT-2's split
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence([digits, tk.pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = tk.decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as SmolLM2's
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    trainer = tk.trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet)
    text = SMOLLM2_TEMPLATE + " ".join([*PROMPTS, BASE_REPLY, USER_REPLY])
    tok.train_from_iterator([text] * 3, trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    ends = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}
    settings = {**ends, "chat_template": SMOLLM2_TEMPLATE, "tokenizer_class": "GPT2Tokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    (folder / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    config = transformers.LlamaConfig(
        vocab_size=416, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64, **generation,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **ends)
    chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": BASE_REPLY}] for p in PROMPTS]
    chats.append([{"role": "user", "content": USER_REPLY}, {"role": "assistant", "content": BASE_REPLY}])
    rows = [
        fast(fast.apply_chat_template(c, chat_template=SMOLLM2_TEMPLATE, tokenize=False))["input_ids"] for c in chats
    ]
    n = max(map(len, rows))
    ids = torch.tensor([r + [2] * (n - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (n - len(r)) for r in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        model(ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(folder)


def put_in_hub_cache(folder: Path, cache: Path, repo: str, commit: str = "0123456789abcdef" * 2 + "01234567") -> None:
    """The files of `folder` as huggingface_hub caches `repo` at `commit` under HF_HUB_CACHE: blobs named by their
    ETag (a git blob sha1, an LFS file's sha256), the snapshot's files linked to them, refs/main naming the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    for sub in (root / "blobs", root / "refs", snapshot):
        sub.mkdir(parents=True)
    (root / "refs" / "main").write_text(commit, encoding="utf-8")
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        lfs = path.suffix == ".safetensors"
        etag = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (root / "blobs" / etag).write_bytes(data)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", etag))


def offline_hub(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine whose Hugging Face cache holds the tiny HUB_MODEL and nothing else, and that
    never tries the network."""
    import huggingface_hub

    cache = tmp_path / "hf-home" / "hub"
    tiny_smollm2(tmp_path / "smollm2")
    put_in_hub_cache(tmp_path / "smollm2", cache, HUB_MODEL)
    scan = huggingface_hub.scan_cache_dir(cache)  # huggingface_hub reads the layout as its own
    assert not scan.warnings and [(r.repo_id, r.nb_files) for r in scan.repos] == [(HUB_MODEL, 5)], scan
    return {
        "HF_HOME": str(cache.parent),
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def hub_commands(commands: list[Command]) -> list[Command]:
    """The README's commands on the open model: those naming hf:, and those reading what they wrote."""
    out, written = [], set()
    for command in commands:
        if any(a.startswith("hf:") or a in written for a in command.args):
            out.append(command)
            written |= {command.args[i + 1] for i, a in enumerate(command.args[:-1]) if a in ("--out", "--name")}
    return out


HUB_RUNNER = """
import json, sys
from typer.testing import CliRunner
from nanogpt_cli.cli import app
for args, stdin in json.load(sys.stdin):
    result = CliRunner().invoke(app, args, terminal_width=100, input=stdin)
    print(json.dumps([result.exit_code, result.stdout, result.output]), flush=True)
"""


def run_hub_commands(commands: list[Command], env: dict[str, str]) -> list[Command]:
    """Run the open model's commands in one process started with the offline hub's environment (huggingface_hub
    reads it at import), each through the CLI as written: each must succeed and print the first line the README
    shows, and each chat, typed TYPED, must answer in one turn that stops at the model's end of turn: BASE_REPLY
    from the model, USER_REPLY from the fine-tune on the user's chats."""
    jobs = []
    for command in commands:
        typed = [line.removeprefix(">>> ") for line in command.shown if line.startswith(">>> ")] or [TYPED]
        jobs.append([command.args, "".join(f"{t}\n" for t in typed) if command.args[0] in INTERACTIVE else None])
    proc = subprocess.run(
        [sys.executable, "-c", HUB_RUNNER], input=json.dumps(jobs), env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    for command, (code, stdout, output) in zip(commands, results, strict=True):
        assert code == 0, f"nanogpt {shlex.join(command.args)}:\n{output}"
        if command.args[0] in INTERACTIVE:
            assert stdout == (BASE_REPLY if command.args[1].startswith("hf:") else USER_REPLY) + "\n", output
        first_shown = next((line for line in command.shown if line.strip()), None)
        if first_shown is not None:
            first = next((line for line in stdout.splitlines() if line.strip()), "")
            assert digits(first).startswith(digits(first_shown.split("...")[0])), output
    return commands


@pytest.mark.slow
def test_the_readme_examples_run_as_written_and_print_what_it_shows(tmp_path):
    """The examples run one after another in a fresh folder: every nanogpt command as written (train with the
    tiny preset), torchrun's on the CPU, the open model's on a tiny model of its form in an offline Hugging Face
    cache (run_hub_commands). The set-up chain is left out (it installs, then trains for minutes). Each command
    must succeed and print the first line the README shows (numbers aside). Fine-tunes run a tenth of their
    updates (fewer_updates): what they teach is the benchmarks' to measure (bench_finetune.py, bench_rl.py)."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
    )
    runner = CliRunner()
    ran = []
    cwd, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(tmp_path)
    torch.set_num_threads(1)  # tiny models: more threads only wait on each other, badly so on a busy machine
    try:
        hub = hub_commands(commands())
        (tmp_path / "chats.jsonl").write_text(user_chats(), encoding="utf-8")
        ran += [c.args[0] for c in run_hub_commands(hub, dict(env, **offline_hub(tmp_path)))]
        for command in (c for c in commands() if not c.setup and c.args[0] not in LONG_RUNNING and c not in hub):
            if command.kind == "torchrun":
                if "--device" not in command.args or "cpu" not in command.args:
                    continue  # GPUs only: its flags are checked above
                args = command.args[command.args.index("torchrun") + 1 :]
                proc = subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", *args],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                assert proc.returncode == 0, proc.stderr[-3000:]
                output = proc.stdout
            elif "--nproc" in command.args:  # the launcher starts processes that print to the real stdout
                proc = subprocess.run(
                    [sys.executable, "-m", "nanogpt_cli", *tiny(command.args)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,  # as a terminal shows them: the note among the lines
                    text=True,
                    timeout=300,
                )
                assert proc.returncode == 0, proc.stdout[-3000:]
                output = proc.stdout
            elif command.kind == "python":
                proc = subprocess.run(
                    [sys.executable, *command.args[1:]], env=env, capture_output=True, text=True, timeout=300
                )
                assert proc.returncode == 0, proc.stderr[-3000:]
                output = proc.stdout
            else:
                args = {"train": tiny, "finetune": fewer_updates}.get(command.args[0], list)(command.args)
                typed = [line.removeprefix(">>> ") for line in command.shown if line.startswith(">>> ")]
                stdin = "".join(line + "\n" for line in typed) if command.args[0] in INTERACTIVE else None
                result = runner.invoke(app, args, terminal_width=100, input=stdin)
                assert result.exit_code == 0, f"nanogpt {shlex.join(args)}:\n{result.output}"
                output = result.stdout
                if command.args[0] in INTERACTIVE:  # the replies of a tiny model are not the README's
                    ran.append(command.args[0])
                    continue
            if command.args[0] == "info":  # the rows it shows, and the model in words (numbers aside)
                shown, printed = box_rows(command.shown), box_rows(output.splitlines())
                assert list(shown) == list(printed) and digits(shown["model"]) == digits(printed["model"]), output
            first_shown = next((line for line in command.shown if line.strip()), None)
            if first_shown is not None and "..." not in first_shown:
                first = next((line for line in output.splitlines() if line.strip()), "")
                assert digits(first).startswith(digits(first_shown)), f"{shlex.join(command.args)} printed:\n{output}"
            ran.append(command.args[0])
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
    assert {"prepare", "train", "sample", "eval", "export", "runs", "info", "plot", "torchrun"} <= set(ran)
    assert {"python", "finetune", "chat"} <= set(ran)  # the fine-tuning example, end to end


def test_the_readme_starts_from_the_open_model_and_fine_tunes_it_with_lora():
    top = README.split("\n## Commands\n")[0]
    assert f"nanogpt chat hf:{HUB_MODEL}\n" in top
    hub = [c.args for c in hub_commands(commands())]
    steps = [(a[0], a[a.index("--format") + 1] if "--format" in a else None, "--lora" in a) for a in hub]
    assert steps == [
        ("chat", None, False),
        ("prepare", "chat", False),
        ("finetune", None, True),
        ("chat", None, False),
        ("export", "peft", False),
        ("export", "gguf", False),
    ], steps
    assert all(shlex.join(args) in top for args in hub)  # all near the top, where a newcomer starts
    example = json.loads(re.search(r"```json\n(.*?)```", top, flags=re.S).group(1))  # the chats.jsonl line shown
    assert [m["role"] for m in example["messages"]] == ["user", "assistant"]
    assert example["messages"][1]["content"] == USER_REPLY  # what the test's chats teach, as the README's does


@pytest.mark.slow
def test_an_open_model_missing_from_an_offline_cache_is_one_sentence(tmp_path):
    (tmp_path / "hub").mkdir()
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "nanogpt_cli", "chat", "hf:SomeOrg/missing"],
        input="Hello\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert proc.stderr == (
        f"error: hf:SomeOrg/missing is not in the Hugging Face cache ({tmp_path / 'hub'}) and HF_HUB_OFFLINE (or "
        "TRANSFORMERS_OFFLINE) is set, so nanogpt cannot download it; unset it to fetch the model once\n"
    )
