"""bf16 numerics of the GPU sampling path, checked on CPU: the matmul attention CUDA runs keeps
fp32 scores (errors of PyTorch's flash kernel, not of bf16 scores), and the sampler records
log-probs at exactly the trainer's temperature (fp32 logits / T, not a bf16 1/T)."""
import math

import pytest
import torch

from common.engine.model.attention import _CPU_FLASH, attend_lse_gqa
from common.engine.checkpoints.hf_io import load_model
from common.engine.model.transformer import Transformer
from common.engine.model.model_config import ModelConfig
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from common.contracts.ops import token_logp
from tests.tiny import save_hf


def _reference(q, k, v, mask):
    """float64 attention on the same (bf16-rounded) inputs: the exact answer."""
    G = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask.double()
    lse = torch.logsumexp(s, -1)
    return (s - lse[..., None]).exp() @ v, lse


@pytest.mark.skipif(_CPU_FLASH is None, reason="needs PyTorch's CPU flash kernel as the yardstick")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gqa_attention_in_bf16_keeps_fp32_scores(seed):
    """Peaked scores (std ~16), 9 query heads over 3 kv heads, 300 keys, a padding mask: output
    and log-sum-exp errors against float64 within 1.5x of the flash kernel's on the same inputs
    (bf16 scores before the softmax gave ~0.13 on both)."""
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, Tq, Tk, hd = 2, 9, 3, 4, 300, 64
    q = (4 * torch.randn(B, H, Tq, hd, generator=g)).bfloat16()
    k = (4 * torch.randn(B, Hkv, Tk, hd, generator=g)).bfloat16()
    v = torch.randn(B, Hkv, Tk, hd, generator=g).bfloat16()
    mask = torch.zeros(B, 1, Tq, Tk, dtype=torch.bfloat16)
    mask[1, ..., 250:] = float("-inf")  # the second row's keys end at 250
    out, lse = _reference(q, k, v, mask)
    assert float((q.double() @ k.double().repeat_interleave(3, 1).transpose(-1, -2) / 8).std()) > 12  # peaked
    o1, l1 = attend_lse_gqa(q, k, v, mask)
    o2, l2 = _CPU_FLASH(q, k, v, attn_mask=mask)
    assert o1.dtype == torch.bfloat16 and l1.dtype == torch.float32
    ours = ((o1.double() - out).abs().max(), (l1.double() - lse).abs().max())
    flash = ((o2.double() - out).abs().max(), (l2.double() - lse).abs().max())
    assert ours[0] <= 1.5 * flash[0], (ours, flash)
    assert ours[1] <= 1.5 * flash[1], (ours, flash)


def _head_only_model(scale: float = 8.0) -> Transformer:
    """No layers: hidden = norm(embedding), so the sampler's and the trainer's hidden states are
    the same numbers and any log-prob difference is the head's and the temperature's. Large
    weights give peaked logits (|logit| ~ 20-30, like a trained LM's), where a bf16 1/T shows."""
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=0,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    m = Transformer(cfg)
    with torch.no_grad():
        m.lm_head.weight.normal_(0, scale / math.sqrt(cfg.hidden_size))
        m.model.embed_tokens.weight.normal_()
    return m.to(torch.bfloat16).eval()


@pytest.mark.parametrize("T", [0.7, 1.3])
def test_sampler_logp_equals_trainer_logp_in_bf16(T):
    m = _head_only_model()
    outs = Sampler(m, max_batch=8, max_seq_len=40).generate(
        [[5, 6, 7], [9] * 10, [40, 41, 42, 43]], SamplingParams(max_new_tokens=20, temperature=T, n=3, seed=0))
    worst = 0.0
    for c in outs:
        with torch.no_grad():
            full = token_logp(m, torch.tensor([c.prompt_tokens + c.tokens]), T)[0, len(c.prompt_tokens):]
        worst = max(worst, float((c.logp_tensor() - full).abs().max()))
    assert worst <= 1e-3, worst
    # the yardstick would see a bf16 1/T: logits / bf16(1/T)^-1 is a different temperature
    lg = m.lm_head(m.hidden(torch.tensor([[5, 6, 7]]))[:, -1]).float()
    inv = torch.tensor(1 / T).bfloat16().float()
    drift = (torch.log_softmax(lg * inv, -1) - torch.log_softmax(lg / T, -1)).abs().max()
    assert drift > 5e-3, float(drift)


def test_first_token_logp_is_the_trainers_in_bf16(tmp_path):
    """With real layers the decode path's kernels differ from the full forward's in the last bf16
    bits; the first token (drawn from the prefill) goes through the same kernels: equal."""
    save_hf("qwen3_qknorm", tmp_path)
    m = load_model(str(tmp_path), dtype=torch.bfloat16, tokenizer=False)[0]
    outs = Sampler(m, max_batch=8, max_seq_len=64).generate(
        [[5, 6, 7], [9] * 10, [40, 41, 42, 43]], SamplingParams(max_new_tokens=12, temperature=0.7, n=3, seed=0))
    for c in outs:
        with torch.no_grad():
            full = token_logp(m, torch.tensor([c.prompt_tokens + c.tokens]), 0.7)[0, len(c.prompt_tokens):]
        assert abs(c.logp[0] - float(full[0])) <= 1e-3
        torch.testing.assert_close(c.logp_tensor(), full, atol=1e-2, rtol=0)  # bf16 kernel noise, not temperature
