"""LoRA adapters in PEFT's format, out and in: `adapter_config.json` and `adapter_model.safetensors`
that `peft.PeftModel.from_pretrained` loads onto the transformers model of the base, and such a
folder read back onto our model (`train.lora.init`). Runs in the trainer (checkpoints, the start).

Names: PEFT's keys are the transformers module's, `base_model.model.<module>.lora_A.weight` (A,
(r, in)) and `.lora_B.weight` (B, (out, r)), its scale lora_alpha / r (per module through
`rank_pattern` / `alpha_pattern`). Our modules keep Llama's names for every family
(hf_layouts.py); where a family fuses q, k and v into one projection (GPT-NeoX's query_key_value,
rows per head [H, 3, hd]; GPT-2's c_attn, columns q | k | v) the adapters of q, k and v are one
PEFT adapter of their summed rank, exactly: A stacks theirs, B places each one's rows where its
projection's outputs are and is zero elsewhere. Read back, a fused adapter becomes an adapter on
each of q, k, v with the fused A and that projection's rows of B (a part whose rows are all zero
is no adapter). GPT-2's Conv1D layers take `fan_in_fan_out` (the adapter's math is the same).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common.contracts.errors import UserError
from common.engine.checkpoints.hf_layouts import QKV_HEADS, hf_module
from common.engine.model.lora import Adapter, LoRAConfig, adapters, add_lora, attached

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _rows(cfg, kind: str, x: str) -> torch.Tensor:
    """Indices of projection x's (q, k or v) outputs among a fused projection's (module docstring)."""
    H, hd = cfg.num_attention_heads, cfg.head_dim
    j = "qkv".index(x)
    if kind == QKV_HEADS:  # rows ordered (head, q|k|v, dim)
        return (torch.arange(H)[:, None] * 3 * hd + j * hd + torch.arange(hd)[None, :]).reshape(-1)
    return torch.arange(j * H * hd, (j + 1) * H * hd)  # QKV_COLUMNS: q | k | v


@torch.no_grad()
def save_adapter(model, path, base_model: str = "", dropout: float = 0.0) -> None:
    """Write `model`'s adapters into `path` as PEFT writes a LoRA adapter (module docstring)."""
    cfg, fused, tensors, ranks, alphas = model.cfg, {}, {}, {}, {}
    for name, (m, a) in adapters(model).items():
        hf, kind, x = hf_module(cfg, name)
        if x is None:
            tensors[f"{_PREFIX}{hf}.lora_A.weight"] = a.A.detach().float().cpu().contiguous()
            tensors[f"{_PREFIX}{hf}.lora_B.weight"] = a.B.detach().float().cpu().contiguous()
            ranks[hf], alphas[hf] = a.rank, a.alpha
        else:
            fused.setdefault(hf, (kind, []))[1].append((x, a))
    for hf, (kind, parts) in fused.items():
        scales = {round(a.scale, 12) for _, a in parts}
        if len(scales) > 1:
            raise ValueError(f"{hf}: the adapters of q, k and v have different scales; PEFT's fused adapter has one")
        R = sum(a.rank for _, a in parts)
        A = torch.cat([a.A.detach().float().cpu() for _, a in parts], 0)              # (R, D)
        B = torch.zeros(3 * cfg.num_attention_heads * cfg.head_dim, R)               # (3 H hd, R)
        col = 0
        for x, a in parts:
            B[_rows(cfg, kind, x), col:col + a.rank] = a.B.detach().float().cpu()
            col += a.rank
        tensors[f"{_PREFIX}{hf}.lora_A.weight"], tensors[f"{_PREFIX}{hf}.lora_B.weight"] = A, B
        ranks[hf], alphas[hf] = R, parts[0][1].scale * R
    if not tensors:
        raise ValueError("save_adapter: the model has no adapters")
    r = max(set(ranks.values()), key=list(ranks.values()).count)  # the common rank; the others by pattern
    alpha = next(alphas[k] for k in ranks if ranks[k] == r)
    leaves = sorted({k.rsplit(".", 1)[-1] for k in ranks})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
              "r": r, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": leaves, "bias": "none",
              "fan_in_fan_out": cfg.model_type == "gpt2", "rank_pattern": {}, "alpha_pattern": {},
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "inference_mode": True,
              "modules_to_save": None, "layers_to_transform": None, "revision": None}
    for k in ranks:  # PEFT matches a pattern key against the end of each module's name
        if ranks[k] != r or alphas[k] != alpha:
            config["rank_pattern"][k], config["alpha_pattern"][k] = ranks[k], alphas[k]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _pattern(patterns: dict, module: str, default):
    for k, v in patterns.items():
        if module == k or module.endswith("." + k):
            return v
    return default


@torch.no_grad()
def load_adapter(model, path, dropout: float | None = None, freeze: bool = True) -> list[str]:
    """Adapters read from a PEFT LoRA folder onto `model` (module docstring), each with the file's
    rank and scale; with `freeze` the model's other parameters frozen. Returns our adapted modules."""
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise UserError(f"train.lora.init={path}: not a PEFT adapter folder ({CONFIG} and {WEIGHTS} needed)")
    conf = json.loads((path / CONFIG).read_text())
    if conf.get("peft_type") != "LORA" or conf.get("use_dora") or conf.get("use_rslora"):
        raise UserError(f"train.lora.init={path}: a {conf.get('peft_type')} adapter"
                        f"{' with DoRA' if conf.get('use_dora') else ''}{' with rsLoRA' if conf.get('use_rslora') else ''}; "
                        f"only plain LoRA is read")
    state = load_file(str(path / WEIGHTS))
    ours = {hf_module(model.cfg, n): n for n, m in model.named_modules() if n.endswith("_proj")}
    by_hf: dict[str, list] = {}
    for (hf, kind, x), n in ours.items():
        by_hf.setdefault(hf, []).append((kind, x, n))
    modules, out = dict(model.named_modules()), []
    for key in sorted(k for k in state if k.endswith(".lora_A.weight")):
        hf = key[len(_PREFIX):-len(".lora_A.weight")] if key.startswith(_PREFIX) else key[:-len(".lora_A.weight")]
        hf = hf.replace(".default", "")
        A, B = state[key].float(), state[key.replace("lora_A", "lora_B")].float()
        R = A.shape[0]
        scale = _pattern(conf.get("alpha_pattern") or {}, hf, conf["lora_alpha"]) / \
            _pattern(conf.get("rank_pattern") or {}, hf, conf["r"])
        if hf not in by_hf:
            raise UserError(f"train.lora.init={path}: module {hf!r} of the adapter is not a projection of this model")
        for kind, x, n in by_hf[hf]:
            part = B if x is None else B[_rows(model.cfg, kind, x)]
            if x is not None and not part.any():
                continue  # this projection had no adapter of its own
            m = modules[n]
            m.lora = Adapter(m.in_features, m.out_features, R, scale * R,
                             conf.get("lora_dropout", 0.0) if dropout is None else dropout).to(m.weight.device)
            m.lora.A.copy_(A)
            m.lora.B.copy_(part)
            out.append(n)
    if not out:
        raise UserError(f"train.lora.init={path}: the adapter holds no LoRA weights")
    attached(model, freeze)
    return out


def attach_lora(model, cfg: LoRAConfig, freeze: bool = True) -> list[str]:
    """`cfg`'s adapters on `model`: read from the PEFT folder `cfg.init` (its ranks and scales), else
    fresh ones of `cfg.rank` on `cfg.targets` (B = 0: the base). Returns the adapted modules."""
    if cfg.init:
        return load_adapter(model, cfg.init, cfg.dropout, freeze=freeze)
    return add_lora(model, cfg, freeze=freeze)
