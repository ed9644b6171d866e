"""What a sentence-transformers folder says about serving its model: the modules after the transformer,
the length it truncates to, and its prompts.

    STModules.from_model_dir(path) -> STModules     read once at load; refuses what it cannot run
    .pooling      PoolingConfig (models/pooling.py) from the Pooling module's config.json
    .head(vec)    the modules after pooling, in ``modules.json`` order: Dense (linear, activation, optional
                  residual) and Normalize
    .dim(hidden)  the width of the vectors served
    .max_seq_length, .do_lower_case     sentence_bert_config.json (sentence-transformers truncates there)
    .prompt(name) the text put before every input: ``name`` from config_sentence_transformers.json's
                  ``prompts``, None = its ``default_prompt_name`` (or none)

``modules.json`` is the pipeline: Transformer, then Pooling, Dense and Normalize modules. Any other module
(LayerNorm, WordWeights, a Router, a custom class...) would change the vectors in a way this server does
not reproduce: it is refused with a ValueError naming it. A folder without ``modules.json`` (a plain HF
model) gets what sentence-transformers gives it: mean pooling, nothing after.

When a Normalize module follows Pooling directly, ``pooling.normalize`` is set and ``head`` does nothing:
the pooled vector is normalised where it is pooled (the lean and padding-free forwards do it on their own
output). With Dense modules, pooling does not normalise and ``head`` runs every module after it.

A Pooling module with ``include_prompt: false`` leaves the prompt's tokens out of the mean; this server
pools every token, so such a folder is refused when it defines a non-empty prompt (without prompts the
two are the same).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from batchpilot.models.pooling import PoolingConfig, modes_from
from batchpilot.models.tokens import InvalidInput

# the Transformer module's config, under the names sentence-transformers has read over the years
_TRANSFORMER_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json",
                        "sentence_distilbert_config.json", "sentence_camembert_config.json",
                        "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                        "sentence_xlnet_config.json")
# Dense activations (sentence-transformers saves the torch.nn class's full name); Tanh is its default
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Tanh": torch.tanh, "Identity": lambda x: x, "GELU": F.gelu, "ReLU": F.relu, "Sigmoid": torch.sigmoid,
    "SiLU": F.silu,
}
_SUPPORTED = ("Transformer", "Pooling", "Dense", "Normalize")
_EMBEDDING = "sentence_embedding"  # the feature Dense and Normalize read and write in a sentence model


@dataclass(frozen=True, eq=False)
class Dense:
    """A sentence-transformers ``Dense`` module: ``activation(x @ weight.T + bias)``, plus ``x`` (or
    ``x @ residual.T`` when the widths differ) when ``use_residual``."""

    weight: torch.Tensor  # [out_features, in_features]
    bias: torch.Tensor | None
    activation: str  # a key of _ACTIVATIONS
    use_residual: bool = False
    residual: torch.Tensor | None = None  # [out_features, in_features] when the widths differ

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = _ACTIVATIONS[self.activation](F.linear(x, self.weight, self.bias))
        if self.use_residual:
            out = out + (x if self.residual is None else F.linear(x, self.residual))
        return out

    def to(self, device: torch.device) -> Dense:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, weight=self.weight.to(device), bias=move(self.bias),
                       residual=move(self.residual))

    @classmethod
    def load(cls, folder: Path) -> Dense:
        """From a Dense module's folder: ``config.json``, and ``model.safetensors`` (else
        ``pytorch_model.bin``)."""
        cfg = _read_json(folder / "config.json")
        if not isinstance(cfg, dict) or "in_features" not in cfg or "out_features" not in cfg:
            raise ValueError(f"{folder}: a Dense module needs a config.json with in_features and "
                             "out_features")
        for key in ("module_input_name", "module_output_name"):
            if cfg.get(key) not in (None, _EMBEDDING):
                raise ValueError(f"{folder}: a Dense module on {cfg[key]!r} (not the sentence embedding) is "
                                 "not supported")
        act_path = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
        act = "Identity" if act_path is None else str(act_path).rsplit(".", 1)[-1]
        if act not in _ACTIVATIONS or (act_path is not None and not str(act_path).startswith("torch.nn.")):
            raise ValueError(f"{folder}: Dense activation {act_path!r} is not supported; one of torch.nn's "
                             f"{', '.join(_ACTIVATIONS)}")
        n_in, n_out, bias = int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True))
        residual = bool(cfg.get("use_residual", False))
        weights = _load_weights(folder)
        want = {"linear.weight": (n_out, n_in), **({"linear.bias": (n_out,)} if bias else {}),
                **({"residual.weight": (n_out, n_in)} if residual and n_in != n_out else {})}
        for key, shape in want.items():
            got = weights.get(key)
            if got is None or tuple(got.shape) != shape:
                raise ValueError(f"{folder}: Dense weight {key} should have shape {shape}, found "
                                 f"{None if got is None else tuple(got.shape)}")
        return cls(weights["linear.weight"].float(), weights["linear.bias"].float() if bias else None, act,
                   residual, weights["residual.weight"].float() if "residual.weight" in want else None)


@dataclass(frozen=True, eq=False)
class STModules:
    """The sentence-transformers pipeline of a model folder (see the module docstring)."""

    pooling: PoolingConfig = field(default_factory=PoolingConfig)
    after: tuple[Dense | str, ...] = ()  # the modules after pooling, in order: Dense, or "normalize"
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None

    @property
    def normalize(self) -> bool:
        """Whether the served vectors are L2-normalised (a Normalize module is last)."""
        return self.pooling.normalize or (bool(self.after) and self.after[-1] == "normalize")

    @property
    def dense(self) -> tuple[Dense, ...]:
        return tuple(m for m in self.after if isinstance(m, Dense))

    def dim(self, hidden: int) -> int:
        """The width of the served vectors over a transformer of width ``hidden``."""
        dense = self.dense
        return dense[-1].out_features if dense else hidden * len(self.pooling.modes)

    def head(self, vec: torch.Tensor) -> torch.Tensor:
        """The modules after pooling, applied to pooled vectors ``[n, width]`` (float32)."""
        for module in self.after:
            vec = F.normalize(vec, p=2.0, dim=-1) if isinstance(module, str) else module(vec)
        return vec

    def to(self, device: torch.device) -> STModules:
        return replace(self, after=tuple(m if isinstance(m, str) else m.to(device) for m in self.after))

    def prompt(self, name: str | None) -> str:
        """The text put before each input: prompt ``name``, or the default prompt when None (else "").
        An unknown name is an ``InvalidInput`` that lists the known ones."""
        if name is None:
            return self.prompts.get(self.default_prompt_name, "") if self.default_prompt_name else ""
        if name not in self.prompts:
            known = ", ".join(repr(k) for k in self.prompts) or "none (it defines no prompts)"
            raise InvalidInput(f"unknown prompt_name {name!r}; this model's prompts are: {known}",
                               code="invalid_prompt_name")
        return self.prompts[name]

    @classmethod
    def from_model_dir(cls, path: str | Path) -> STModules:
        """Read a model folder (see the module docstring); a ValueError names what it cannot serve."""
        root = Path(path)
        modules = _read_json(root / "modules.json")
        pooling_dir: Path | None = None
        after: list[Dense | str] = []
        if isinstance(modules, list):
            for i, module in enumerate(modules):
                kind = str(module.get("type", ""))
                name = kind.rsplit(".", 1)[-1]
                if not kind.startswith("sentence_transformers.") or name not in _SUPPORTED:
                    raise ValueError(
                        f"{root}: sentence-transformers module {kind!r} (modules.json entry {i}) is not "
                        f"supported (batchpilot runs {', '.join(_SUPPORTED)}); serve a model without it")
                folder = root / str(module.get("path", ""))
                if name == "Pooling":
                    pooling_dir = folder
                elif name == "Dense":
                    after.append(Dense.load(folder))
                elif name == "Normalize":
                    after.append("normalize")
        elif (root / "1_Pooling" / "config.json").exists():
            pooling_dir = root / "1_Pooling"
        pool_cfg = (_read_json(pooling_dir / "config.json") or {}) if pooling_dir is not None else {}
        pooling = PoolingConfig(modes=modes_from(pool_cfg))
        if after == ["normalize"]:  # normalised where it is pooled (the lean forwards do it themselves)
            pooling, after = replace(pooling, normalize=True), []
        st_cfg = next((c for c in (_read_json(root / n) for n in _TRANSFORMER_CONFIGS) if c), None) or {}
        max_seq = st_cfg.get("max_seq_length")
        extra = _read_json(root / "config_sentence_transformers.json") or {}
        prompts = {str(k): str(v) for k, v in (extra.get("prompts") or {}).items()}
        default = extra.get("default_prompt_name")
        if default is not None and default not in prompts:
            raise ValueError(f"{root}: default_prompt_name {default!r} is not one of its prompts "
                             f"({', '.join(prompts) or 'none'})")
        if not pool_cfg.get("include_prompt", True) and any(prompts.values()):
            raise ValueError(f"{root}: its Pooling leaves prompt tokens out (include_prompt: false), which "
                             "batchpilot does not do; serve it without prompts")
        return cls(pooling, tuple(after), int(max_seq) if max_seq else None,
                   bool(st_cfg.get("do_lower_case", False)), prompts, default)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return dict(load_file(str(folder / "model.safetensors")))
    if (folder / "pytorch_model.bin").is_file():
        return dict(torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True))
    raise ValueError(f"{folder}: a Dense module needs model.safetensors or pytorch_model.bin")
