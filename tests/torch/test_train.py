"""The distributed trainer: 2 gloo processes reproduce 1 process on the same global batch (float64), the
folder loads in attnkit's NumPy CausalLM and in transformers with the same logits, resume continues exactly,
and bad arguments give one line on stderr and exit status 2."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import torch
from attnkit.pretrained import load_causal_lm
from attnkit.torch import train

LLAMA = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


@pytest.fixture
def run_files(tmp_path: Path) -> tuple[Path, Path]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, LLAMA["vocab_size"], size=3000))
    return config, data


def _args(config: Path, data: Path, out: Path, steps: int = 3, *extra: str) -> list[str]:
    return ["--config", str(config), "--data", str(data), "--steps", str(steps), "--global-batch", "4",
            "--seq-len", "8", "--lr", "3e-3", "--seed", "7", "--dtype", "float64", "--warmup", "1",
            "--grad-clip", "0.5", "--out", str(out), *extra]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def _weights(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    return load_file(str(folder / "model.safetensors"))


def test_two_processes_match_one_and_the_folder_loads_everywhere(run_files, tmp_path):
    config, data = run_files
    one, two = tmp_path / "one", tmp_path / "two"
    single = _run([sys.executable, "-m", "attnkit.torch.train", *_args(config, data, one)])
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
          f"--master_port={_free_port()}", "-m", "attnkit.torch.train", *_args(config, data, two)])
    assert [line.split()[:2] for line in single.stdout.splitlines()[:3]] == [["step", f"{i}/3"] for i in (1, 2, 3)]

    a, b = _weights(one), _weights(two)
    assert sorted(a) == sorted(b) and "lm_head.weight" in a and "model.layers.1.self_attn.k_proj.weight" in a
    worst = max(float(np.abs(a[k] - b[k]).max() / np.abs(a[k]).max()) for k in a)
    print(f"\n1 vs 2 processes: largest relative weight difference {worst:.2e}")
    assert worst <= 1e-9

    # The safetensors folder holds exactly the trained twin (checkpoint.pt), under Hugging Face names.
    lm = load_causal_lm(two, dtype=np.float64)
    state = torch.load(two / "checkpoint.pt", weights_only=True)["model"]
    for name, array in lm.named_parameters():
        assert np.array_equal(array, state[name].numpy()), name
    from attnkit.models import CausalLM
    init = CausalLM(lm.config, rng=7)
    assert np.abs(lm.layers[0].attention.W_Q - init.layers[0].attention.W_Q).max() > 1e-4  # it trained

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(two, dtype=torch.float64).eval()
    ids = np.random.default_rng(1).integers(0, LLAMA["vocab_size"], size=(2, 10))
    mask = np.ones_like(ids, dtype=bool)
    mask[1, :3] = False  # left padding: positions from the mask in both libraries
    ours = lm(ids, attention_mask=mask)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64))).logits.numpy()
    rel = float(np.abs(ours[mask] - theirs[mask]).max() / np.abs(theirs[mask]).max())
    print(f"NumPy vs transformers logits of the trained folder: {rel:.2e}")
    # transformers computes its rotary inverse frequencies in float32 even for a float64 model.
    assert rel <= 1e-6


class _Stop(Exception):
    pass


def test_resume_continues_exactly(run_files, tmp_path, monkeypatch, capsys):
    config, data = run_files
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train.main(_args(config, data, straight, 4)) == 0

    save = train._save_checkpoint

    def save_then_crash(path, model, optimizer, step, raw):
        save(path, model, optimizer, step, raw)
        raise _Stop  # a run killed right after its step-2 checkpoint

    monkeypatch.setattr(train, "_save_checkpoint", save_then_crash)
    with pytest.raises(_Stop):
        train.main(_args(config, data, resumed, 4, "--checkpoint-every", "2"))
    assert not (resumed / "model.safetensors").exists()
    assert [p.name for p in resumed.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    monkeypatch.setattr(train, "_save_checkpoint", save)
    capsys.readouterr()
    assert train.main(_args(config, data, resumed, 4, "--resume")) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("step 3/4")
    a, b = _weights(straight), _weights(resumed)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("change,message", [
    (lambda a, p: a.__setitem__(a.index("--dtype") + 1, "float16"), "--dtype"),
    (lambda a, p: a.__setitem__(a.index("--steps") + 1, "0"), "--steps"),
    (lambda a, p: a.__setitem__(a.index("--config") + 1, str(p / "missing.json")), "--config"),
    (lambda a, p: a.__setitem__(a.index("--data") + 1, str(p / "config.json")), "--data"),
    (lambda a, p: a.__setitem__(a.index("--seq-len") + 1, "5000"), "--data"),
    (lambda a, p: a.append("--resume"), "--resume"),
])
def test_bad_arguments_exit_2_with_one_line(run_files, tmp_path, capsys, change, message):
    config, data = run_files
    args = _args(config, data, tmp_path / "out")
    change(args, tmp_path)
    assert train.main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_config_and_batch_split_errors(run_files, tmp_path, capsys, monkeypatch):
    config, data = run_files
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(LLAMA, model_type="bert")))
    assert train.main(_args(bad, data, tmp_path / "o")) == 2
    assert "model_type" in capsys.readouterr().err
    tokens = tmp_path / "big.npy"
    np.save(tokens, np.full(100, 40))
    assert train.main(_args(config, tokens, tmp_path / "o")) == 2
    assert "vocab_size=32" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert train.main(_args(config, data, tmp_path / "o")) == 2
    assert "multiple of the 3 processes" in capsys.readouterr().err


FAMILY_CONFIGS = {
    "gpt2": {"model_type": "gpt2", "vocab_size": 32, "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 32,
             "activation_function": "gelu_new"},
    "qwen2": {"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
              "max_position_embeddings": 64, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "sliding_window": 4},
    "gemma2": {"model_type": "gemma2", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
               "query_pre_attn_scalar": 4, "max_position_embeddings": 64, "sliding_window": 4},
    "olmo2": {"model_type": "olmo2", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
    "apertus": {"model_type": "apertus", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}},
    "glm4": {"model_type": "glm4", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
             "max_position_embeddings": 64, "pad_token_id": 0, "eos_token_id": 1},
    "granite": {"model_type": "granite", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "embedding_multiplier": 2.0, "attention_multiplier": 0.3,
                "residual_multiplier": 0.5, "logits_scaling": 3.0},
    "hunyuan_v1_dense": {"model_type": "hunyuan_v1_dense", "vocab_size": 32, "hidden_size": 16,
                         "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "head_dim": 4, "max_position_embeddings": 64},
    "gpt_oss": {"model_type": "gpt_oss", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 8,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
                "num_local_experts": 3, "num_experts_per_tok": 2, "sliding_window": 4,
                "max_position_embeddings": 64},
    "qwen3_5_text": {"model_type": "qwen3_5_text", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
                     "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 4,
                     "linear_value_head_dim": 4, "layer_types": ["linear_attention", "full_attention"],
                     "max_position_embeddings": 64, "partial_rotary_factor": 0.5},
    "qwen3_next": {"model_type": "qwen3_next", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
                   "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 4,
                   "linear_value_head_dim": 4, "layer_types": ["linear_attention", "full_attention"],
                   "num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                   "shared_expert_intermediate_size": 8, "max_position_embeddings": 64,
                   "partial_rotary_factor": 0.5},
    "qwen3_moe": {"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
                  "num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "mlp_only_layers": [1],
                  "max_position_embeddings": 64},
    "mixtral": {"model_type": "mixtral", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 8,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 3,
                "num_experts_per_tok": 2, "max_position_embeddings": 64},
    "lfm2": {"model_type": "lfm2", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "conv_bias": True,
             "block_auto_adjust_ff_dim": False, "layer_types": ["conv", "full_attention"],
             "max_position_embeddings": 64},
    "bamba": {"model_type": "bamba", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_indices": [1],
              "mamba_n_heads": 4, "mamba_d_state": 4, "mamba_n_groups": 2, "mamba_d_conv": 3, "mamba_chunk_size": 4,
              "max_position_embeddings": 64},
    "falcon_h1": {"model_type": "falcon_h1", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_d_ssm": 16,
                  "mamba_n_heads": 4, "mamba_d_state": 4, "mamba_n_groups": 2, "mamba_d_conv": 3,
                  "mamba_chunk_size": 4, "mamba_rms_norm": True, "max_position_embeddings": 64,
                  "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5, "key_multiplier": 0.7,
                  "attention_in_multiplier": 0.8, "attention_out_multiplier": 1.2, "ssm_in_multiplier": 1.1,
                  "ssm_out_multiplier": 0.9, "mlp_multipliers": [0.8, 1.25],
                  "ssm_multipliers": [0.5, 1.5, 0.75, 1.25, 2.0]},
}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_family_round_trips_through_the_hugging_face_folder(family, run_files, tmp_path, capsys):
    _, data = run_files
    config = tmp_path / f"{family}.json"
    config.write_text(json.dumps(FAMILY_CONFIGS[family]))
    out = tmp_path / family
    assert train.main(_args(config, data, out, 2, "--quiet")) == 0
    assert capsys.readouterr().out == ""
    lm = load_causal_lm(out, dtype=np.float64)
    state = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    for name, array in lm.named_parameters():
        assert np.array_equal(array, state[name].numpy()), name

    from transformers import AutoModelForCausalLM
    # eager experts: the grouped-GEMM path of mixture-of-experts models runs in float32 only
    extra = {"experts_implementation": "eager"} if family in ("gpt_oss", "qwen3_next", "qwen3_moe", "mixtral") else {}
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, **extra).eval()
    ids = np.random.default_rng(1).integers(0, 32, size=(2, 9))
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids)).logits.numpy()
    rel = float(np.abs(lm(ids) - theirs).max() / np.abs(theirs).max())
    assert rel <= 1e-6, rel


def _one_line(err: str, *fragments: str) -> None:
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_an_unwritable_out_is_refused_before_training(run_files, tmp_path, capsys):
    config, data = run_files
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert train.main(_args(config, data, blocker / "run")) == 2
    _one_line(capsys.readouterr().err, "--out: cannot write to")


def test_a_fresh_run_does_not_overwrite_an_earlier_one(run_files, tmp_path, capsys):
    config, data = run_files
    out = tmp_path / "run"
    assert train.main(_args(config, data, out, 2, "--quiet")) == 0
    before = (out / "model.safetensors").read_bytes()
    assert train.main(_args(config, data, out, 2, "--quiet", "--seed", "8")) == 2
    _one_line(capsys.readouterr().err, "already holds a run (checkpoint.pt, model.safetensors, config.json)",
              "--resume", "--overwrite")
    assert (out / "model.safetensors").read_bytes() == before
    assert train.main(_args(config, data, out, 2, "--quiet", "--overwrite", "--seed", "8")) == 0
    assert (out / "model.safetensors").read_bytes() != before


def test_resume_refuses_a_checkpoint_beyond_steps_or_damaged(run_files, tmp_path, capsys):
    config, data = run_files
    out = tmp_path / "run"
    assert train.main(_args(config, data, out, 3, "--quiet")) == 0
    checkpoint = (out / "checkpoint.pt").read_bytes()
    assert train.main(_args(config, data, out, 2, "--quiet", "--resume")) == 2
    _one_line(capsys.readouterr().err, "is at step 3, beyond --steps 2")
    assert (out / "checkpoint.pt").read_bytes() == checkpoint  # not rewritten with a wrong step
    (out / "checkpoint.pt").write_bytes(checkpoint[: len(checkpoint) // 2])
    assert train.main(_args(config, data, out, 4, "--quiet", "--resume")) == 2
    _one_line(capsys.readouterr().err, "--resume:", "is not a checkpoint this trainer wrote")


def test_absurd_batch_and_ctrl_c_are_one_line(run_files, tmp_path, capsys, monkeypatch):
    config, data = run_files
    args = _args(config, data, tmp_path / "run")
    args[args.index("--global-batch") + 1] = str(10**9)
    assert train.main(args) == 2
    _one_line(capsys.readouterr().err, "--global-batch 1000000000 exceeds the 2992 distinct windows")

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "_train", interrupted)
    assert train.main(_args(config, data, tmp_path / "run2")) == 130
    _one_line(capsys.readouterr().err, "interrupted")
