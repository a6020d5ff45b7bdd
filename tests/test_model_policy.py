"""Tiny policy model: build from ModelConfig, save/load round trip through
load_pretrained_policy (local dir, file:// and s3:// URIs), clear errors for missing files."""

import shutil

import pytest
import torch

from tasks.policy import tokenizer as T
from tasks.policy.model import (
    MissingModelFileError,
    build_hf_config,
    build_tiny_model,
    check_model_dir,
    load_pretrained_policy,
    num_parameters,
    resolve_model_dir,
)
from tests.fixtures.vllm import tiny_model_config


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_round_trip_same_weights_and_tokenizer(tiny_policy_dir):
    model, tok = load_pretrained_policy(tiny_policy_dir)
    assert model.config.model_type == "qwen3_moe" and next(model.parameters()).dtype == torch.float32
    assert T.special_token_ids(tok)[T.IM_END] == model.config.eos_token_id
    assert model.generation_config.eos_token_id == model.config.eos_token_id
    ids = T.prompt_ids(tok, [{"role": "user", "content": "hello"}])
    again, tok2 = load_pretrained_policy(str(tiny_policy_dir))
    assert torch.equal(logits(model, ids), logits(again, ids))
    assert tok2.chat_template == tok.chat_template == T.CHAT_TEMPLATE


def test_build_is_seeded(tiny_policy_dir):
    _, tok = load_pretrained_policy(tiny_policy_dir)
    a = build_tiny_model(tiny_model_config(), tok)
    b = build_tiny_model(tiny_model_config(), tok)
    c = build_tiny_model(tiny_model_config(seed=1), tok)
    ids = [1, 50, 60, 70]
    assert torch.equal(logits(a, ids), logits(b, ids))
    assert not torch.equal(logits(a, ids), logits(c, ids))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_5_moe"])
def test_each_arch_builds_and_runs(tiny_policy_dir, arch):
    _, tok = load_pretrained_policy(tiny_policy_dir)
    cfg = tiny_model_config(arch=arch)
    model = build_tiny_model(cfg, tok)
    out = model(torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]]))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert model.config.vocab_size == cfg.vocab_size and model.config.hidden_size == cfg.hidden_size
    total, active = num_parameters(model), num_parameters(model, active=True)
    assert (active < total) == (arch != "qwen3")


def test_default_config_size():
    # The mini preset's model: a few million active parameters (report in bench_model.py).
    tok = T.train_tokenizer(["x = 1\n"] * 20, vocab_size=300)
    cfg = tiny_model_config(vocab_size=4096)
    hf = build_hf_config(cfg.model_copy(update={"vocab_size": 4096}), tok)
    assert hf.num_experts == cfg.num_experts and hf.moe_intermediate_size == cfg.intermediate_size // 2


def test_missing_files_are_named(tiny_policy_dir, tmp_path):
    for name in ["config.json", "tokenizer.json", "model.safetensors"]:
        d = tmp_path / name.replace(".", "_")
        shutil.copytree(tiny_policy_dir, d)
        (d / name).unlink()
        with pytest.raises(MissingModelFileError, match=name.replace(".", r"\.")):
            load_pretrained_policy(d)
    with pytest.raises(MissingModelFileError, match="does not exist"):
        check_model_dir(tmp_path / "nowhere")


def test_file_uri_is_copied_to_cache(tiny_policy_dir, tmp_path):
    cache = tmp_path / "cache"
    local = resolve_model_dir(tiny_policy_dir.as_uri(), cache)
    assert local.parent == cache and (local / ".complete").exists()
    assert resolve_model_dir(tiny_policy_dir.as_uri(), cache) == local  # reused
    model, _ = load_pretrained_policy(tiny_policy_dir.as_uri(), cache_dir=cache)
    ref, _ = load_pretrained_policy(tiny_policy_dir)
    assert torch.equal(logits(model, [1, 2, 3]), logits(ref, [1, 2, 3]))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_policy_dir, broken)
    (broken / "tokenizer_config.json").unlink()
    with pytest.raises(MissingModelFileError, match=r"tokenizer_config\.json"):
        resolve_model_dir(broken.as_uri(), cache)
    assert [p.name for p in cache.iterdir()] == [local.name]  # no half copies left


def test_s3_uri(tiny_policy_dir, tmp_path, s3_endpoint, s3_bucket):
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    fs.put(str(tiny_policy_dir) + "/", f"{s3_bucket}/ckpt/v0", recursive=True)
    model, tok = load_pretrained_policy(f"s3://{s3_bucket}/ckpt/v0", cache_dir=tmp_path,
                             storage_options={"endpoint_url": s3_endpoint})
    ref, _ = load_pretrained_policy(tiny_policy_dir)
    assert torch.equal(logits(model, [1, 2, 3]), logits(ref, [1, 2, 3]))
    with pytest.raises(MissingModelFileError):
        resolve_model_dir(f"s3://{s3_bucket}/ckpt/missing", tmp_path, {"endpoint_url": s3_endpoint})
