"""``attnkit chat`` driven through a pseudo-terminal: streamed replies equal the library's greedy reply, the
conversation grows turn by turn, /reset and /exit, --verbose reports, and bad input is one line with exit 2."""
from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from attnkit.cli.chat import terminal_safe
from cli_helpers import SRC, greedy_reply, run_attnkit

pytest.importorskip("transformers")
pytest.importorskip("jinja2")


def chat_in_pty(args, lines, timeout=120):
    """Run ``attnkit chat *args`` on a pseudo-terminal, typing each line once the prompt shows; returns
    (everything the terminal showed, stderr, exit code)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "attnkit", "chat", *map(str, args)], stdin=follower,
                            stdout=follower, stderr=subprocess.PIPE, env=env, close_fds=True)
    os.close(follower)
    shown = b""
    pending = list(lines)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
            if pending and shown.endswith(b"> "):
                os.write(leader, pending.pop(0).encode() + b"\n")
        elif proc.poll() is not None:
            break
    code = proc.wait(timeout=timeout)
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    os.close(leader)
    return shown.decode().replace("\r\n", "\n"), stderr, code


def test_chat_streams_replies_keeps_the_conversation_and_resets(folder):
    system = "You are a helpful assistant."
    first = greedy_reply(folder, [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}], 12)
    second = greedy_reply(folder, [{"role": "system", "content": system}, {"role": "user", "content": "Hello"},
                                   {"role": "assistant", "content": first},
                                   {"role": "user", "content": "how are you"}], 12)
    shown, stderr, code = chat_in_pty(["--system", system, "--max-new-tokens", 12, "--temperature", 0, "--verbose",
                                       folder], ["Hello", "how are you", "/reset", "Hello", "/exit"])
    assert code == 0, stderr
    first, second = terminal_safe(first), terminal_safe(second)  # random weights write control characters too
    assert f"> Hello\n{first}\n> how are you\n{second}\n> /reset\n(conversation reset)\n> Hello\n{first}\n> /exit" \
        in shown
    assert first != second  # the second turn saw the first: the conversation grows
    assert "loaded" in stderr and stderr.count(", generated 12 tokens at ") == 3  # one speed line per reply


def test_end_of_input_ends_the_chat(folder):
    proc = run_attnkit(["chat", folder, "--max-new-tokens", "3"], cwd=folder)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


@pytest.mark.parametrize("args, match", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "2"], "argument --top-p: must be a number in [0, 1], got 2"),
    (["--num-beams", "2"], "--num-beams: beam search settles its tokens only at the end"),
    (["--chat-template", "missing.jinja"], "--chat-template 'missing.jinja' is neither a file nor the name of"),
    (["--chat-template", "."], "--chat-template '.' is not a file"),
])
def test_bad_options_are_one_line_and_exit_2(folder, args, match):
    proc = run_attnkit(["chat", folder, *args], cwd=folder)
    err = proc.stderr
    assert proc.returncode == 2 and match in err and len(err.strip().splitlines()) == 1


def test_a_folder_without_a_chat_template_is_exit_2(folder, tmp_path):
    import shutil

    copy = shutil.copytree(folder, tmp_path / "copy")
    (copy / "chat_template.jinja").unlink()
    proc = run_attnkit(["chat", copy], cwd=tmp_path)
    err = proc.stderr
    assert proc.returncode == 2 and "no chat template" in err and "Traceback" not in err
    proc = run_attnkit(["chat", tmp_path / "missing"], cwd=tmp_path)
    assert proc.returncode == 2 and "is not a folder" in proc.stderr


# -- the chat template: present before loading, by name or by file ----------------------------------------
@pytest.fixture(scope="module")
def no_template(folder, tmp_path_factory):
    """The chat folder without its chat template, and with weights that cannot be read: a command that read
    them would fail with another message."""
    import shutil

    copy = shutil.copytree(folder, tmp_path_factory.mktemp("bare") / "model")
    (copy / "chat_template.jinja").unlink()
    assert "chat_template" not in (copy / "tokenizer_config.json").read_text()
    (copy / "model.safetensors").write_bytes(b"not weights")
    return copy


@pytest.fixture(scope="module")
def no_template_gguf(tmp_path_factory):
    """A tiny GGUF file without a chat template, its tensor data cut off."""
    gguf_models = pytest.importorskip("gguf_models")
    path = tmp_path_factory.mktemp("bare_gguf") / "model.gguf"
    gguf_models.write_gguf(gguf_models.build_model("llama"), path)
    path.write_bytes(path.read_bytes()[:-4096])
    return path


@pytest.mark.parametrize("model, command", [("folder", ["chat"]), ("folder", ["generate", "--prompt", "hi", "--chat"]),
                                            ("gguf", ["chat"])])
def test_a_model_without_a_chat_template_is_refused_before_its_weights_are_read(no_template, no_template_gguf,
                                                                                model, command, tmp_path):
    path = no_template if model == "folder" else no_template_gguf
    proc = run_attnkit([command[0], path, *command[1:]], cwd=tmp_path)
    err = proc.stderr
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "has no chat template" in err and "give one with --chat-template NAME or FILE (NAME: chatml," in err
    assert "chat_template=" not in err  # the Python argument is not the command line's
    assert "safetensors" not in err and "truncated" not in err  # no weight was read


def greedy_with_template(folder, template, text, max_new_tokens=8):
    import numpy as np

    from attnkit.pretrained import load

    model, tok = load(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_dict=False, chat_template=template)
    out = model.generate(np.array([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=list(tok.eos_token_ids))
    return terminal_safe(tok.decode(out[0, len(ids):], skip_special_tokens=True))


def chat_reply(folder, template, cwd):
    proc = subprocess.run([sys.executable, "-m", "attnkit", "chat", str(folder), "--chat-template", template,
                           "--temperature", "0", "--max-new-tokens", "8"], input=b"Hello\n", capture_output=True,
                          timeout=300, cwd=cwd, env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


def test_chat_template_names_a_familys_format_and_a_file_of_that_name_wins(folder, tmp_path):
    """``--chat-template chatml`` renders with the ChatML format; a file named ``chatml`` in the working folder
    is read instead, as the help says."""
    import shutil

    from attnkit.pretrained.named_chat_templates import NAMED_CHAT_TEMPLATES

    bare = shutil.copytree(folder, tmp_path / "bare")
    (bare / "chat_template.jinja").unlink()
    assert chat_reply(bare, "ChatML", tmp_path) == greedy_with_template(folder, NAMED_CHAT_TEMPLATES["chatml"],
                                                                        "Hello") + "\n"
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    (tmp_path / "chatml").write_text(own)
    by_file = chat_reply(bare, "chatml", tmp_path)
    assert by_file == greedy_with_template(folder, own, "Hello") + "\n"
    assert by_file != chat_reply(bare, "chatml", bare)  # elsewhere the name is the format again


def test_help_names_the_formats(tmp_path):
    text = " ".join(run_attnkit(["chat", "--help"], tmp_path).stdout.split())
    assert "--chat-template NAME|FILE" in text
    assert "chatml, qwen2, qwen2.5, qwen3, llama2, llama3, llama3.1, mistral, gemma, phi3, zephyr" in text
    assert "a FILE that exists wins over a NAME" in text
